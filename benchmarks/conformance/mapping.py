"""Every pfedkit option of a conformance run beside the PFLlib flag that does the same, per method.

Two tables, read by the runner (conformance.py) and checked by tests/test_conformance.py (every
pfedkit key named here exists and is what the run resolves to):
- PROTOCOL: the settings every method shares (model, rounds, local epochs, batch size, lr,
  optimiser, participation, evaluation point and weighting, seeds), one row per setting;
- METHODS: per method, pfedkit's algorithm and options, PFLlib's `-algo` and flags, which of
  PFLlib's printed evaluations of a round is the curve, and every departure of one library from the
  other that the options cannot remove (file and line in PFLlib `system/`, at the commit of the table).

A split (`SPLITS`) is a pfedkit config file beside this module plus PFLlib's `-data` name prefix
(its model choice reads the name: "MNIST" -> FedAvgCNN(1, dim=1024), "Cifar10" -> dim=1600).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Setting:
    """One shared setting: pfedkit's key and value, PFLlib's flag (None: not a flag) and value."""
    pfedkit_key: str
    pfedkit_value: object
    pfllib_flag: str | None
    pfllib_value: str
    note: str


@dataclass(frozen=True)
class Split:
    name: str
    config: Path             # the pfedkit config of the split and protocol (rounds overridable)
    pfllib_dataset: str      # PFLlib's -data prefix: its model choice reads it
    rounds: int              # the rounds of the committed table (the paper's, cut: README)


@dataclass(frozen=True)
class Method:
    label: str
    pfedkit: str                                      # pfedkit algorithm name
    pfllib: str                                       # PFLlib -algo
    pfedkit_options: dict = field(default_factory=dict)  # key=value overrides (dotted keys)
    pfllib_flags: dict = field(default_factory=dict)     # flag -> value
    pfllib_evaluation: str = "last"   # which 'Averaged Test Accuracy' of a round block is the curve
    departures: tuple[str, ...] = ()  # what neither library's options remove
    pfllib_commit: str | None = None  # a PFLlib commit other than the table's that this row runs against


SPLITS = {
    "mnist_fedrema": Split("mnist_fedrema", HERE / "mnist_fedrema.yaml", "MNIST", rounds=25),
    "cifar10_dir01": Split("cifar10_dir01", HERE / "cifar10_dir01.yaml", "Cifar10", rounds=25),
}

# The shared protocol. The split's own settings (clients, partition, E, B, lr) are in its YAML;
# the rows below state how each becomes a PFLlib flag or behaviour.
PROTOCOL = (
    Setting("model", "cnn", "-m", "CNN", "both PFLlib's FedAvgCNN: conv 32-5, pool, conv 64-5, pool, fc 512, fc C "
            "(pfedkit/models/cnn.py); PyTorch default initialisation on both sides"),
    Setting("num_clients", None, "-nc", "N", "the split's clients, exported file by file"),
    Setting("join_ratio", 1.0, "-jr", "1", "every client every round"),
    Setting("participants", "floor", None, "int(N * jr)", "PFLlib's count of participants (serverbase.py:27)"),
    Setting("rounds", None, "-gr", "R", "PFLlib evaluates rounds 0..R (0 = the initial model) and trains after "
            "its last evaluation; pfedkit evaluates rounds 1..R; round r = after r aggregations on both"),
    Setting("local_epochs", None, "-ls", "E", "epochs over the client's training rows"),
    Setting("batch_size", None, "-lbs", "B", ""),
    Setting("lr", None, "-lr", "lr", ""),
    Setting("momentum", 0.0, None, "plain SGD", "PFLlib's clients build torch.optim.SGD(lr) without momentum "
            "(clientbase.py:49), unless a method says otherwise"),
    Setting("weight_decay", 0.0, None, "none", ""),
    Setting("grad_clip", None, None, "none", "PFLlib clips nothing in these methods"),
    Setting("drop_last", True, None, "DataLoader(drop_last=True)", "clientbase.py:57: the last, incomplete batch "
            "of an epoch is dropped"),
    Setting("keep_optimizer_state", True, None, "one optimizer per client", "no state to keep in plain SGD"),
    Setting("eval_every", 1, "-eg", "1", "every round"),
    Setting("eval_point", "after_download", None, "after send_models", "PFLlib evaluates at the start of a round, "
            "after the download (serveravg.py:26-31): pfedkit's after_download"),
    Setting("headline.weighting", "weighted", None, "sum correct / sum test samples",
            "serverbase.py evaluate(): sample-weighted over all clients; the curves here are that accuracy"),
    Setting("headline.point", "best", None, "max over rounds", "PFLlib prints its best round; rows here show "
            "best, last-10 mean and round of best"),
    Setting("threads", 1, None, "OMP_NUM_THREADS=1", "one torch thread a side, so both sides can run at once"),
    Setting("seed", None, None, "torch.manual_seed(s + seed)", "pfedkit's seed draws the partition, the "
            "initialisation and the batches; PFLlib seeds torch with 0 at import (main.py:63) and in every "
            "client (clientbase.py:17): the launcher adds the seed to both and seeds numpy and random with it "
            "(PFLlib leaves them unseeded: client order and drop-out draws); seed 0 is PFLlib as shipped. Seed s "
            "of both sides uses pfedkit's partition of seed s"),
)

METHODS = {m.label: m for m in (
    Method("FedAvg", "fedavg", "FedAvg", pfllib_evaluation="last"),
    Method("FedProx", "fedprox", "FedProx", {"fedprox.mu": 1.0}, {"-mu": 1.0},
           departures=("PFLlib's default -mu is 0 (FedAvg); both set to FedReMa's mu = 1",)),
    Method("FedPer", "fedper", "FedPer"),
    Method("FedRep", "fedrep", "FedRep", {"fedrep.head_epochs": 1}, {"-pls": 1},
           departures=("head epochs: PFLlib's -pls default 1 on both (pfedkit's default is the paper's 10)",)),
    Method("Ditto", "ditto", "Ditto", {"ditto.lam": 1.0, "ditto.personal_epochs": 1}, {"-mu": 1.0, "-pls": 1},
           pfllib_evaluation="last",
           departures=("PFLlib prints the global models' accuracy, then the personalised models'; the curve is "
                       "the personalised one (serverditto.py:29-36); its printed best is over both",)),
    Method("LG-FedAvg", "lg_fedavg", "LG-FedAvg"),
    Method("FedBABU", "fedbabu", "FedBABU", {"fedbabu.finetune_epochs": 0}, {"-fte": 0},
           departures=("PFLlib evaluates the global model (body + fixed random head) every round and fine-tunes "
                       "once after the last round (serverbabu.py:59-63): pfedkit's finetune_epochs=0 is the "
                       "per-round curve",)),
    Method("MOON", "moon", "MOON", {"moon.mu": 1.0, "moon.tau": 0.5}, {"-mu": 1.0, "-tau": 0.5},
           departures=("PFLlib's defaults are -mu 0 (FedAvg) and -tau 1; both set to mu = 1, tau = 0.5",)),
    Method("FedProto", "fedproto", "FedProto", {"fedproto.lam": 1.0}, {"-lam": 1.0}),
    Method("FedDistill", "feddistill", "FD",
           {"feddistill.lam": 1.0, "feddistill.distill_loss": "pfllib_ce",
            "feddistill.upload_logits": "training_passes"}, {"-lam": 1.0},
           departures=("PFLlib's FD (clientfd.py:45-50) distils by CrossEntropyLoss(z, z̄_y) with the raw global "
                       "logits as targets: pfedkit's distill_loss=pfllib_ce; its default is the spec's KL",
                       "PFLlib uploads the mean logits of the round's training passes: upload_logits="
                       "training_passes",
                       "a sample whose class has no global vector: PFLlib's target is its own logits (not 0 "
                       "for the CE), pfedkit's term is 0; only in round 1 and for classes nobody holds")),
    Method("FedDistill-softmax", "feddistill", "FD",
           {"feddistill.lam": 1.0, "feddistill.distill_loss": "kl", "feddistill.upload_logits": "training_passes"},
           {"-lam": 1.0}, pfllib_commit="87689a0437f04a800c64da9cd3565ff8eab9afeb",
           departures=("PFLlib at 87689a0 (2025-11-25, the parent of the table's commit) distils by "
                       "CrossEntropyLoss(z, softmax(z̄_y)) (clientfd.py:50): the same gradient as pfedkit's KL "
                       "(they differ by the entropy of softmax(z̄_y), a constant); d832e76 changed that line to "
                       "the raw logits (row FedDistill)",)),
    Method("Per-FedAvg", "perfedavg", "PerAvg", {"perfedavg.variant": "fo", "perfedavg.beta": "LR",
                                                "local_epochs": "2E"}, {},
           departures=("PFLlib's client sets beta = lr whatever -bt says (clientperavg.py:14): pfedkit's beta "
                       "= lr here (its default is 1e-3)",
                       "PFLlib calls each client's train() twice a round (serverperavg.py:34-36): pfedkit's "
                       "local_epochs = 2E",
                       "PFLlib evaluates after one SGD step of B samples from the global model, as pfedkit")),
    Method("Local", "local", "Local"),
    Method("pFedMe", "pfedme", "pFedMe", {"pfedme.lam": 15.0, "pfedme.inner_steps": 5, "pfedme.personal_lr": 0.01,
                                          "pfedme.beta": 1.0, "pfedme.mu": 0.001},
           {"-lam": 15.0, "-K": 5, "-lrp": 0.01, "-bt": 1.0},
           departures=("PFLlib's default -bt is 0: its server mix (1 - beta) w + beta mean keeps the initial model "
                       "for ever (serverpFedMe.py:88-91); both set to beta = 1",
                       "PFLlib's pFedMeOptimizer mu is its default 0.001 (not a flag): pfedkit's mu = 0.001",
                       "PFLlib evaluates each client's theta from its last inner problem of the previous round "
                       "(clientpFedMe.py:79-81): not yet compared with pfedkit's evaluated model")),
    Method("APFL", "apfl", "APFL", {"apfl.alpha_init": 0.5, "apfl.adaptive": True}, {"-al": 0.5},
           departures=("PFLlib's alpha step adds 0.02 alpha to the gradient and clips alpha to [0, 1] "
                       "(clientapfl.py:76-78): not in pfedkit, not yet measured",)),
    Method("FedAMP", "fedamp", "FedAMP", {"fedamp.alpha_k": 1.0, "fedamp.lam": 1.0, "fedamp.sigma": 1.0},
           {"-alk": 1.0, "-lam": 1.0, "-sg": 1.0},
           departures=("PFLlib's defaults (alpha_K = lam = sigma = 1) on both; pfedkit's are cwFedAvg's",)),
    Method("FedFomo", "fedfomo", "FedFomo", {"fedfomo.num_peers": 5, "fedfomo.epsilon": 0.0,
                                            "fedfomo.val_ratio": 0.2}, {"-M": 5},
           departures=("PFLlib's validation rows are the last 20 % of the training rows, fixed (clientfomo.py:66); "
                       "pfedkit draws them at random once per client",)),
    Method("FedGH", "fedgh", "FedGH", {"fedgh.server_lr": 1.0, "fedgh.server_batch_size": "B"}, {"-slr": 1.0},
           departures=("PFLlib trains the server head on the prototypes with the clients' batch size "
                       "(servergh.py:93): pfedkit's server_batch_size = B",)),
    Method("FedRoD", "fedrod", "FedROD", {"fedrod.gamma": 1.0}),
    Method("FedPAC", "fedpac", "FedPAC", {"fedpac.lam": 1.0}, {"-lam": 1.0},
           departures=("PFLlib's FedPAC needs the real cvxpy (its head weights); not stubbed for this method",)),
)}


def pfedkit_overrides(method: Method, split: Split, seed: int, rounds: int) -> list[str]:
    """`key=value` overrides of the split's config for one method, seed and round count."""
    config = read_split_config(split)
    values = {"algorithm": method.pfedkit, "seed": seed, "rounds": rounds}
    for key, value in method.pfedkit_options.items():
        values[key] = resolve_placeholder(value, config)
    return [f"{key}={value}" for key, value in values.items()]


def resolve_placeholder(value, config: dict):
    """'LR' -> the split's lr, '2E' -> twice its local epochs, 'B' -> its batch size; anything else as is."""
    if value == "LR":
        return config["lr"]
    if value == "B":
        return config["batch_size"]
    if value == "2E":
        return 2 * config["local_epochs"]
    return value


def read_split_config(split: Split) -> dict:
    import yaml

    return yaml.safe_load(split.config.read_text())


def pfllib_arguments(method: Method, split: Split, dataset_name: str, rounds: int, tag: str) -> list[str]:
    """main.py's arguments for one method on the exported split."""
    config = read_split_config(split)
    arguments = {"-data": dataset_name, "-m": "CNN", "-algo": method.pfllib, "-gr": rounds, "-dev": "cpu",
                 "-nc": config["num_clients"], "-ncl": 10, "-jr": config["join_ratio"],
                 "-ls": config["local_epochs"], "-lbs": config["batch_size"], "-lr": config["lr"],
                 "-eg": 1, "-t": 1, "-go": tag}
    arguments.update(method.pfllib_flags)
    return [str(item) for pair in arguments.items() for item in pair]


def pfedkit_config(method: Method, split: Split, seed: int = 0, rounds: int | None = None):
    """The validated pfedkit Config a conformance run uses (ConfigError on an unknown key or value)."""
    from pfedkit.config import load_config

    return load_config(str(split.config), pfedkit_overrides(method, split, seed, rounds or split.rounds))


def dotted(mapping: dict, key: str):
    """`mapping["a"]["b"]` for key "a.b" (KeyError when absent)."""
    value = mapping
    for part in key.split("."):
        value = value[part]
    return value
