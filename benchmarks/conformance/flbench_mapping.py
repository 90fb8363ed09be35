"""Every shared pfedkit setting of a conformance run beside the FL-bench setting that does the same.

FL-bench takes its settings as hydra overrides of `config/defaults.yaml` (`common.local_epoch=5`);
a method's own hyperparameters live in its section (`fedprox.mu`), given here as `++section.key=value`
(added or replaced). FLBENCH_PROTOCOL: the settings every method shares, each pfedkit key beside
FL-bench's, checked by tests/test_conformance_flbench.py (every pfedkit key named here exists and is
what the run resolves to). The methods, FlbenchMethod each, are in flbench_methods.py. The splits are
mapping.SPLITS: FL-bench's dataset name is the split's pfedkit `dataset`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mapping import Split, pfedkit_overrides, read_split_config, resolve_placeholder

FLBENCH_COMMIT = "06e658bca5af6ce732e25bb7c0f8be321e14a85e"
FLBENCH_DATASETS = {"mnist": "mnist", "cifar10": "cifar10"}  # pfedkit dataset -> FL-bench dataset.name


@dataclass(frozen=True)
class FlbenchSetting:
    """One shared setting: pfedkit's key and value, FL-bench's key (None: not a key) and value."""
    pfedkit_key: str
    pfedkit_value: object
    flbench_key: str | None
    flbench_value: str
    note: str


@dataclass(frozen=True)
class FlbenchMethod:
    label: str
    pfedkit: str                                          # pfedkit algorithm name
    flbench: str                                          # FL-bench `method=` (its src/server/<name>.py)
    pfedkit_options: dict = field(default_factory=dict)   # key=value overrides (dotted keys)
    flbench_options: dict = field(default_factory=dict)   # hydra key -> value (method sections: "++" added)
    departures: tuple[str, ...] = ()
    # Where FL-bench's curve is read (flbench_run): "before" metrics.csv's accuracy_test_before; "clients"
    # main.log's per-client lines pooled by test rows; "test_results" main.log's closing JSON (with
    # ++common.test.client.interval=1), "test_results_after" its fine-tuned side. FL-bench's epoch or key k
    # is pfedkit's round k + round_shift.
    curve: str = "before"
    round_shift: int = 0


# The split's own settings (clients, partition, E, B, lr) are in its YAML; these rows state how each
# becomes an FL-bench setting. pfedkit's side of an FL-bench row runs the split's YAML with the
# pfedkit values below (its own run directories: METHOD-flbench-sS), which differ from the PFLlib rows'
# protocol where FL-bench's loop does (drop_last).
FLBENCH_PROTOCOL = (
    FlbenchSetting("model", "cnn", "model.name", "avgcnn", "both FedAvgCNN: conv 32-5, pool, conv 64-5, pool, fc 512, "
                   "fc C (src/utils/models.py:132); PyTorch default initialisation on both sides; the head is the "
                   "last layer (FL-bench's `classifier`)"),
    FlbenchSetting("num_clients", None, None, "partition.pkl", "the split's clients, exported (flbench_data.py)"),
    FlbenchSetting("join_ratio", 1.0, "common.join_ratio", "1.0", "every client every round (int(N * jr), "
                   "src/server/fedavg.py:119-125)"),
    FlbenchSetting("rounds", None, "common.global_epoch", "R + 1", "FL-bench evaluates each round's received "
                   "model before training ('before', epoch e = after e aggregations; e = 0 the initial model): "
                   "R + 1 epochs give pfedkit's rounds 1..R"),
    FlbenchSetting("local_epochs", None, "common.local_epoch", "E", ""),
    FlbenchSetting("batch_size", None, "common.batch_size", "B", ""),
    FlbenchSetting("lr", None, "optimizer.lr", "lr", ""),
    FlbenchSetting("momentum", 0.0, "optimizer.momentum", "0", "optimizer.name=sgd, dampening 0, no Nesterov"),
    FlbenchSetting("weight_decay", 0.0, "optimizer.weight_decay", "0", ""),
    FlbenchSetting("grad_clip", None, None, "none", "FL-bench clips nothing in FedAvg's loop"),
    FlbenchSetting("drop_last", False, None, "DataLoader(shuffle=True)", "src/client/fedavg.py:77-79: the last, "
                   "incomplete batch is kept; FL-bench skips a batch of one sample (fit, :239-240), pfedkit "
                   "does not: the same unless a client's training rows are 1 mod B"),
    FlbenchSetting("keep_optimizer_state", True, "common.reset_optimizer_on_global_epoch", "true",
                   "plain SGD keeps no state"),
    FlbenchSetting("eval_every", 1, "common.client_side_evaluation", "true", "every round, on every participant, "
                   "before and after its training; common.test.client.interval=-1 (no second evaluation)"),
    FlbenchSetting("eval_point", "after_download", None, "accuracy_test_before", "the model each client received "
                   "(FedAvgClient.train_with_eval): pfedkit's after_download"),
    FlbenchSetting("headline.weighting", "weighted", None, "Metrics pooled over clients", "display_metrics pools "
                   "the participants' predictions (src/utils/metrics.py): sample-weighted"),
    FlbenchSetting("threads", 1, None, "OMP_NUM_THREADS=1", "one torch thread a side"),
    FlbenchSetting("seed", None, "common.seed", "s", "FL-bench seeds random, numpy and torch once with s "
                   "(fix_random_seed, src/server/fedavg.py:55) before building the model; pfedkit's seed draws the "
                   "partition, the initialisation and the batches. Seed s of both sides uses pfedkit's partition "
                   "of seed s"),
)

# Settings every FL-bench run takes beyond the protocol: CPU, one process, no plots or monitors.
FLBENCH_FIXED = {"model.use_torchvision_pretrained_weights": "false", "optimizer.name": "sgd", "optimizer.dampening": 0,
                 "optimizer.nesterov": "false", "mode": "serial", "common.use_cuda": "false", "common.buffers": "global",
                 "common.test.client.interval": -1, "common.test.client.test": "true",
                 "common.test.client.finetune_epoch": 0, "common.test.server.interval": -1,
                 "common.straggler_ratio": 0, "common.save_learning_curve_plot": "false",
                 "common.save_metrics": "true", "common.save_log": "true", "common.save_model": "false",
                 "common.monitor": "null", "common.verbose_gap": 1}


FLBENCH_PFEDKIT = {"drop_last": False}  # pfedkit's overrides of the split's YAML for FL-bench's loop


def flbench_dataset(split: Split) -> str:
    """FL-bench's dataset.name of a split (its model and normalisation read the name)."""
    dataset = read_split_config(split)["dataset"]
    if dataset not in FLBENCH_DATASETS:
        raise SystemExit(f"split {split.name}: dataset {dataset!r} has no FL-bench counterpart here")
    return FLBENCH_DATASETS[dataset]


def flbench_arguments(method: FlbenchMethod, split: Split, rounds: int, seed: int) -> list[str]:
    """main.py's hydra overrides for one method on the exported split."""
    config = read_split_config(split)
    values = {"method": method.flbench, "dataset.name": flbench_dataset(split), "model.name": "avgcnn",
              "common.seed": seed, "common.join_ratio": config["join_ratio"], "common.global_epoch": rounds + 1,
              "common.local_epoch": config["local_epochs"], "common.batch_size": config["batch_size"],
              "optimizer.lr": config["lr"], "optimizer.momentum": config["momentum"],
              "optimizer.weight_decay": config["weight_decay"], "common.reset_optimizer_on_global_epoch": "true",
              "common.client_side_evaluation": "true", **FLBENCH_FIXED}
    arguments = [f"{key}={value}" for key, value in values.items() if key not in method.flbench_options]
    arguments += [f"++{key}={resolve_placeholder(value, config)}" for key, value in method.flbench_options.items()]
    return arguments


def flbench_pfedkit_overrides(method: FlbenchMethod, split: Split, seed: int, rounds: int) -> list[str]:
    """pfedkit's overrides of the split's YAML for an FL-bench row: the method, FL-bench's loop."""
    shared = pfedkit_overrides(method, split, seed, rounds)
    return shared + [f"{key}={str(value).lower()}" for key, value in FLBENCH_PFEDKIT.items()]


def flbench_mapping_text(methods: list[FlbenchMethod], not_comparable: dict[str, str]) -> str:
    lines = ["shared protocol against FL-bench (pfedkit key = value | FL-bench key value | note):"]
    lines += [f"  {s.pfedkit_key} = {s.pfedkit_value} | {s.flbench_key or '-'} {s.flbench_value} | {s.note}"
              for s in FLBENCH_PROTOCOL]
    lines.append("  fixed on FL-bench's side: " + " ".join(f"{k}={v}" for k, v in FLBENCH_FIXED.items()))
    for m in methods:
        options = " ".join(f"{k}={v}" for k, v in m.pfedkit_options.items())
        flags = " ".join(f"++{k}={v}" for k, v in m.flbench_options.items())
        lines.append(f"{m.label}: pfedkit algorithm={m.pfedkit} {options} | FL-bench method={m.flbench} {flags}")
        lines += [f"  departure: {d}" for d in m.departures]
    lines += [f"{label}: not comparable: {why}" for label, why in not_comparable.items()]
    return "\n".join(lines)
