"""Every pfedkit option of a conformance run beside the FL-bench setting that does the same, per method.

FL-bench takes its settings as hydra overrides of `config/defaults.yaml` (`common.local_epoch=5`);
a method's own hyperparameters live in its section (`fedprox.mu`), given here as `++section.key=value`
(added or replaced). Two tables, read by the runner (conformance.py) and checked by
tests/test_conformance_flbench.py (every pfedkit key named here exists and is what the run resolves to):
- FLBENCH_PROTOCOL: the settings every method shares, each pfedkit key beside FL-bench's;
- FLBENCH_METHODS: per method, pfedkit's algorithm and options, FL-bench's method and overrides, and
  every departure the options cannot remove (file and line in FL-bench at the commit of the table).
The splits are mapping.SPLITS: FL-bench's dataset name is the split's pfedkit `dataset`.
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
    # ++common.test.client.interval=1). FL-bench's epoch or key k is pfedkit's round k + round_shift.
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

FLBENCH_METHODS = {m.label: m for m in (
    FlbenchMethod("FedAvg", "fedavg", "fedavg"),
    FlbenchMethod("Local", "local", "local",
                  departures=("FL-bench's Local marks every parameter personal (src/server/local.py: "
                              "all_model_params_personalized): each client keeps its own model, as pfedkit's",)),
    FlbenchMethod("FedAvgM", "fedavgm", "fedavgm",
                  {"fedavgm.beta": 0.9, "fedavgm.server_lr": 1.0, "fedavgm.nesterov": True},
                  {"fedavgm.server_momentum": 0.9},
                  departures=("FL-bench hard-codes the server optimiser as torch SGD(lr=1, momentum=server_momentum, "
                              "nesterov=True) (src/server/fedavgm.py:24-29): pfedkit's nesterov=true, server_lr=1; "
                              "Hsu et al.'s update is heavy-ball (v <- beta v + dw, x <- x - v), so both sides run "
                              "FL-bench's Nesterov reading, not the paper's",
                              "FL-bench's pseudo-gradient is the n_i-weighted mean of the clients' diffs x - y_i "
                              "(src/server/fedavgm.py:37-49, weights len(trainset), src/client/fedavg.py:178,194-199); "
                              "pfedkit's is x - sum p_i y_i: the same up to float rounding",)),
    FlbenchMethod("FedAdam", "fedadam", "fedopt",
                  {"fedadam.server_lr": 0.1, "fedadam.beta1": 0.9, "fedadam.beta2": 0.999, "fedadam.tau": 0.001,
                   "fedadam.initial_v": 0.0},
                  {"fedopt.type": "adam", "fedopt.server_lr": 0.1, "fedopt.beta1": 0.9, "fedopt.beta2": 0.999,
                   "fedopt.tau": 0.001},
                  departures=("FL-bench's defaults are server_lr 0.1 and beta2 0.999 (src/server/fedopt.py:23-24), "
                              "pfedkit's 0.01 (the paper's best CIFAR-10 eta) and 0.99 (the paper's fixed beta2): both "
                              "set to FL-bench's",
                              "FL-bench starts v at 0 (src/server/fedopt.py:78-81); Reddi et al.'s Algorithm 2 asks "
                              "v_{-1} >= tau^2 (pfedkit's default): pfedkit's initial_v=0 follows FL-bench",
                              "FL-bench's Delta is the n_i-weighted mean of y_i - x (src/server/fedopt.py:50-54,91-97), "
                              "as pfedkit's; Algorithm 2 writes the uniform mean, the same here (every client holds 480 "
                              "training rows); FL-bench averages the diffs, pfedkit takes mean - x: float rounding only",)),
    FlbenchMethod("FedYogi", "fedyogi", "fedopt",
                  {"fedyogi.server_lr": 0.1, "fedyogi.beta1": 0.9, "fedyogi.beta2": 0.999, "fedyogi.tau": 0.001,
                   "fedyogi.initial_v": 0.0},
                  {"fedopt.type": "yogi", "fedopt.server_lr": 0.1, "fedopt.beta1": 0.9, "fedopt.beta2": 0.999,
                   "fedopt.tau": 0.001},
                  departures=("FL-bench's defaults are server_lr 0.1 and beta2 0.999 (src/server/fedopt.py:23-24), "
                              "pfedkit's 0.01 and 0.99 (FedAdam's, [ours] for Yogi): both set to FL-bench's",
                              "FL-bench starts v at 0 (src/server/fedopt.py:78-81); Algorithm 2 asks v_{-1} >= tau^2 "
                              "(pfedkit's default): pfedkit's initial_v=0 follows FL-bench",
                              "FL-bench's Delta is the n_i-weighted mean of y_i - x (src/server/fedopt.py:50-54,91-97), "
                              "as pfedkit's; Algorithm 2 writes the uniform mean, the same here (every client holds 480 "
                              "training rows); FL-bench averages the diffs, pfedkit takes mean - x: float rounding only",)),
    FlbenchMethod("FedAdagrad", "fedadagrad", "fedopt",
                  {"fedadagrad.server_lr": 0.1, "fedadagrad.beta1": 0.9, "fedadagrad.tau": 0.001,
                   "fedadagrad.initial_v": 0.0},
                  {"fedopt.type": "adagrad", "fedopt.server_lr": 0.1, "fedopt.beta1": 0.9, "fedopt.tau": 0.001},
                  departures=("FL-bench applies the beta1 first moment to Adagrad too (src/server/fedopt.py:22,100-101, "
                              "default 0.9); pfedkit's default beta1 = 0 (TensorFlow's and Flower's Adagrad) switches "
                              "it off: both set to 0.9, Algorithm 2's m_t",
                              "FL-bench's tau default is 1e-3 (src/server/fedopt.py:25), pfedkit's 1e-2 (the paper's best "
                              "CIFAR-10 value for FedAdagrad): both set to FL-bench's; server_lr 0.1 on both (both defaults)",
                              "FL-bench starts v at 0 (src/server/fedopt.py:78-81); Algorithm 2 asks v_{-1} >= tau^2 "
                              "(pfedkit's default): pfedkit's initial_v=0 follows FL-bench",
                              "FL-bench's Delta is the n_i-weighted mean of y_i - x (src/server/fedopt.py:50-54,91-97), "
                              "as pfedkit's; Algorithm 2 writes the uniform mean, the same here (every client holds 480 "
                              "training rows); FL-bench averages the diffs, pfedkit takes mean - x: float rounding only",)),
    FlbenchMethod("pFedHN", "pfedhn", "pfedhn",
                  {"pfedhn.inner_steps": 25, "pfedhn.embed_dim": 5, "pfedhn.server_steps": "per_client"},
                  {"pfedhn.version": "pfedhn", "pfedhn.embed_dim": 5, "common.buffers": "local"}, curve="clients",
                  departures=(
                      "FL-bench trains E = 5 epochs; pfedkit's pFedHN always trains a fixed number of mini-batches "
                      "(Fit(steps=inner_steps)): inner_steps = 25 = 5 epochs x 5 batches (100,100,100,100,80) of every "
                      "client's 480 training rows, drawn epoch by epoch with drop_last=false, as FL-bench's DataLoader",
                      "FL-bench's default embedding size is int((1 + N) / 4) = 5 (src/server/pfedhn.py:123), pfedkit's "
                      "int(1 + N / 4) = 6: both set to 5; H 100, 3 hidden layers, hn_lr 1e-2, embed_lr = hn_lr, momentum "
                      "0.9, weight decay 1e-3 on every tensor, clip 50 are both sides' defaults (src/server/pfedhn.py:21-31, "
                      "53-74, 103-106)",
                      "FL-bench trains a round's clients one after another, each from the model the hypernetwork generates "
                      "after the previous client's step (src/server/pfedhn.py:76-106; package() per client at "
                      "src/utils/trainer.py:42-44), the paper's one-client-per-step algorithm; pfedkit's participants all "
                      "train from phi^t's models and the steps follow, each VJP at the current phi "
                      "(pfedkit/algorithms/pfedhn.py:183-184): no pfedkit option trains a client from the phi left by the "
                      "round's earlier steps",
                      "FL-bench steps in the round's random.sample order (src/server/fedavg.py:122-128, 468), pfedkit in "
                      "ascending client id",
                      "FL-bench's 'before' is h(v_i; phi) generated at the client's turn (src/server/pfedhn.py:108-117), the "
                      "generated model the paper evaluates but after the round's earlier clients' steps; pfedkit evaluates "
                      "h(v_i; phi) after all of the previous round's steps for every client (evaluated_model custom, "
                      "after_download): only FL-bench's first client of a round sees the same phi",
                      "train_one_round leaves self.selected_clients = [the round's last client] (src/server/pfedhn.py:79) and "
                      "display_metrics pools self.selected_clients (src/server/fedavg.py:729-734): metrics.csv's "
                      "accuracy_test_before is ONE client's 120 test rows per epoch; the 20-client pool must be rebuilt from "
                      "main.log's per-client lines (src/utils/trainer.py:47-50, verbose_gap=1): the mean of the 20 'before' "
                      "test accuracies (equal 120-row test sets = sample-weighted)",
                      "FL-bench's pFedHN refuses common.buffers=global (src/server/pfedhn.py:37-38), which FLBENCH_FIXED sets: "
                      "++common.buffers=local comes later on the command line and wins (hydra applies overrides in order); "
                      "FedAvgCNN has no buffers, so no number changes",
                  )),
    FlbenchMethod("CCVR", "ccvr", "ccvr",
                  {"ccvr.calibration": "every_round", "ccvr.virtual_per_class": 200, "ccvr.calibration_epochs": 1,
                   "ccvr.calibration_lr": "LR", "ccvr.calibration_batch_size": "B"},
                  {"ccvr.sample_per_class": 200, "common.test.client.interval": 1}, curve="test_results",
                  round_shift=1,
                  departures=(
                      "FL-bench calibrates only inside test_client_models (src/server/ccvr.py:25-29), which runs only when "
                      "common.test.client.interval > 0 (src/server/fedavg.py:481-485). With the protocol's -1 it is FedAvg. "
                      "The row sets ++common.test.client.interval=1, which overrides the fixed -1 because hydra applies overrides in order",
                      "FL-bench's metrics.csv 'accuracy_test_before' is always the uncalibrated global model, i.e. FedAvg "
                      "(src/client/fedavg.py:101). The calibrated model's accuracy (test_results[e+1]['all_clients']['before']['test'], "
                      "pooled) is only in main.log's closing JSON (src/server/fedavg.py:978-1010), as 2-decimal percent strings",
                      "FL-bench's test after epoch e calibrates the model just aggregated (e+1 aggregations); pfedkit's round r evaluates "
                      "the calibrated model the round started from (r-1 aggregations): FL-bench's key k is pfedkit's round k+1, and "
                      "pfedkit's round 1 (the calibrated initial model) has no FL-bench counterpart",
                      "FL-bench's client covariance is cov(correction=0), 1/N_ck (src/client/ccvr.py:34), but it is pooled with the "
                      "1/(N_ck - 1) formula (src/server/ccvr.py:58-69). Its class covariance is then not the union's: the within-client "
                      "scatter shrinks by (N_ck - 1)/N_ck, about 0.9 for a minority class with about 10 rows here. pfedkit follows the paper's "
                      "eq. (2) and has no option for FL-bench's reading",
                      "sampling: FL-bench uses np.random.multivariate_normal on numpy's global RNG (src/server/ccvr.py:79-83), "
                      "pfedkit an eigendecomposition with a seeded torch generator; same distribution, different draws",
                      "re-training: FL-bench runs one epoch of plain SGD on the classifier from the global one, at optimizer.lr and "
                      "common.batch_size with shuffle and the last batch kept, softmax over all classes (src/server/ccvr.py:115-132). "
                      "pfedkit's options match it: 200 per class, 1 epoch, lr LR, batch B; pfedkit's defaults are 100, 10, 0.01, 32. "
                      "pfedkit's softmax covers only the calibrated classes, which is the same here because every class has data",
                      "statistics come from all train clients in FL-bench (src/server/ccvr.py:33-35) and from the round's "
                      "participants in pfedkit; with join_ratio 1 these are the same clients",
                      "FL-bench's test path draws from torch's global RNG (the trainloader shuffles in the feature pass, the "
                      "virtual-feature DataLoader) and from numpy's, so its training batches differ from its FedAvg run at the same seed",
                  )),
    FlbenchMethod("kNN-Per", "knnper", "knnper",
                  {"knnper.k": 5, "knnper.lam": 0.5, "knnper.scale": 1.0, "knnper.interpolate": "logits"},
                  {"knnper.k": 5, "knnper.weight": 0.5, "knnper.scale": 1.0, "knnper.capacity": 500,
                   "common.test.client.interval": 1}, curve="test_results",
                  departures=("FL-bench mixes only when the client is testing (src/client/knnper.py:38, else the "
                              "plain FedAvgClient.evaluate at :89-90); train_with_eval's 'before' runs with "
                              "testing=False (src/client/fedavg.py:69,101), so metrics.csv's accuracy_test_before is "
                              "FedAvg's global model without the kNN: the curve here is FL-bench's test path "
                              "instead (curve test_results)",
                              "the kNN-mixed model is evaluated by FL-bench only in test_client_models "
                              "(common.test.client.interval > 0, src/server/fedavg.py:481-485, 532-560: every client, "
                              "the model after E+1 aggregations, stored as test_results[E+1]['all_clients']['before'] "
                              "and printed to main.log at the end, :978-1011), never in metrics.csv (:902-926)",
                              "k: FL-bench's default 5 (src/server/knnper.py:19), pfedkit's 7 (the authors' scripts); "
                              "both set to 5; weight/lam 0.5 and scale/sigma 1 are both defaults",
                              "FL-bench mixes p_kNN with the raw logits, weight * p_kNN + (1 - weight) * z "
                              "(src/client/knnper.py:73-76), as the authors' code; the paper mixes probabilities: "
                              "pfedkit's interpolate=logits reproduces FL-bench (its default is the paper's)",
                              "datastore model: FL-bench embeds the training rows with the very model it evaluates, "
                              "rebuilt at each evaluation (src/client/knnper.py:46-50, 68-71), as the paper; pfedkit "
                              "embeds them with the model downloaded in the client's latest round, so its keys are "
                              "one aggregation older than its queries (docs/algorithms/knnper.md, [ours], no option)",
                              "capacity 500 is compared with the number of batches, len(features) "
                              "(src/client/knnper.py:121,124): 5 batches here, so all 480 rows are stored, as pfedkit",
                              "kernel: both exp(-||phi(x) - phi(x_j)||^2 / (d sigma)), d = 512, squared L2 "
                              "(src/client/knnper.py:96-98, faiss IndexFlatL2 :117); FL-bench divides by sum + 1e-9 "
                              "(:106-108), pfedkit takes the weights relative to the nearest neighbour: the same "
                              "distribution unless every weight underflows in float32 (squared distance > ~5e4)",
                              "FL-bench's kNNPerClient builds faiss.IndexFlatL2 in its constructor "
                              "(src/client/knnper.py:34, 117): with flbench_run.py's raising faiss stub the run fails "
                              "at client creation even with interval=-1; it needs the real faiss-cpu "
                              "(.env/requirements.txt:2 pins 1.9.0)")),
    FlbenchMethod("pFedSim", "pfedsim", "pfedsim", {"pfedsim.warmup": 0.5},
                  {"pfedsim.warmup_round": 12, "common.test.client.interval": 1},
                  curve="test_results",
                  departures=("warm-up length: FL-bench reads warmup_round <= 1 as a share of its common.global_epoch = "
                              "R + 1 epochs (src/server/pfedsim.py:25-28: int(26 * 0.5) = 13 FedAvg rounds), pfedkit as "
                              "a share of R (int(25 * 0.5) = 12); FL-bench gets the count 12 (a value in (1, global_epoch) "
                              "is a round count, :29-30), which is right for R = 25 only",
                              "the model evaluated after the warm-up: FL-bench's accuracy_test_before of epoch e > 12 is "
                              "the personalised download, the client's stored head + the -log(1 - S)-weighted mean of "
                              "epoch e-1's trained bodies (get_client_model_params, src/server/pfedsim.py:104-133, "
                              "evaluated before fit, src/client/fedavg.py:101); pfedkit evaluates each client's own "
                              "stored trained model, unmixed (client_model), which is FL-bench's accuracy_test_after of "
                              "epoch e-1 (src/client/fedavg.py:102-104) and what FL-bench's own test path evaluates "
                              "(testing=True returns the stored model, src/server/pfedsim.py:107-111): from round 13 on "
                              "the two curves measure different models; so the curve here is FL-bench's test path "
                              "(common.test.client.interval=1, main.log's test_results: the global model after k "
                              "aggregations in the warm-up, the stored trained models after it), pfedkit's models",
                              "FL-bench keeps the similarity matrix and the weights -log(1 - s) in float32 "
                              "(src/server/pfedsim.py:36, 119-123), pfedkit in float64 (log1p): rounding only")),
    FlbenchMethod("Floco", "floco", "floco",
                  {"floco.num_endpoints": 10, "floco.projection_round": 10, "floco.radius": 0.1},
                  {"floco.endpoints": 10, "floco.tau": 10, "floco.rho": 0.1, "floco.pers_epoch": 0},
                  departures=("projection: at the start of epoch tau (0-based, after tau aggregations) FL-bench makes "
                              "every client train once more from the current global model, projects those trained "
                              "vertices and discards that pass (src/server/floco.py:47-55); pfedkit projects the vertices "
                              "its round-tau participants uploaded (trained from the global after tau - 1 aggregations), "
                              "with no extra pass: with tau = projection_round = 10 both train in subregions from the "
                              "global after 10 aggregations on and evaluate at the points from round 10 on, but the "
                              "points come from models one round apart (the authors' Flower baseline, like pfedkit, "
                              "takes them from a regular round's uploads)",
                              "vertex initialisation: FL-bench draws every vertex Xavier-normal under "
                              "torch.manual_seed(seed + m) (src/server/floco.py:119-120, 188-192; std sqrt(2/522) = "
                              "0.062), as the authors' Flower baseline does; pfedkit's vertex 0 is the model's own output "
                              "weight and the others PyTorch's default Linear init under seeds of their own (U(+-1/sqrt(512)), "
                              "std 0.026): no pfedkit option gives Xavier-normal vertices",
                              "FL-bench's SimplexLinear keeps nn.Linear's own weight as a registered parameter that the "
                              "`weight` property shadows (src/server/floco.py:114-125): never used in the forward pass, it "
                              "gets no gradient and is averaged unchanged; the bias is a fresh nn.Linear bias (:88-94), "
                              "PyTorch's default as pfedkit's",
                              "PCA: scikit-learn's PCA(n_components=10) of the float32 signatures (src/server/floco.py:"
                              "139-140) takes the 'randomized' solver for a 20 x 51,200 matrix (scikit-learn 1.9.1: "
                              "max(shape) > 500 and 10 < 0.8 * 20), drawing from numpy's global RNG; its 10 + 10 "
                              "oversamples span the centred matrix (rank <= 19), so the scores are the exact SVD's up to "
                              "float32 rounding; pfedkit: exact SVD in float64, same sign rule (largest |loading| positive)")),
)}

# FL-bench methods that do not compute the paper's method under this protocol, read in its code at
# FLBENCH_COMMIT: no row can check pfedkit against them; each is a departure of FL-bench (file:line).
FLBENCH_NOT_COMPARABLE = {
    "pFedLA": "FL-bench's pFedLA is Local: every parameter is personal, so a client receives its own stored "
              "model beside the hypernetwork's mixture (src/server/pfedla.py:112) and loads it after the mixture "
              "(src/client/fedavg.py:143-144), which it overwrites; each client trains and is evaluated on its own "
              "previous model and the hypernetwork never reaches a number (the paper trains and evaluates the mixture)",
    "pFedFDA": "FL-bench's pFedFDA trains FedAvg: its client has no fit of its own (FedAvgClient.fit trains body and "
               "Linear classifier on cross-entropy), computes the statistics, beta and the LDA head only while "
               "testing (src/client/pfedfda.py:69-107), and sends back the Gaussians it received "
               "(src/client/pfedfda.py:49-68), so the pooled means and covariance stay at their U(0, 1) and identity "
               "initialisation (src/server/pfedfda.py:34-37, 86-103); the paper trains the body under the frozen "
               "generative head of the pooled adaptive Gaussians, as pfedkit",
    "FedEM": "FL-bench's FedEM keeps no mixture weights: every round each client restarts from uniform pi "
             "(src/server/fedem.py:44-54, src/client/fedem.py:86-92) and is evaluated at uniform pi with the "
             "components' logits mixed (src/client/fedem.py:192-198), where the paper keeps pi_i and mixes "
             "probabilities; and its M-step weights each row's loss by another row's responsibility (the batch's "
             "weights taken in ascending index order, the batch shuffled: src/client/fedem.py:151-156), a bug",
}

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


def flbench_mapping_text(method: FlbenchMethod | None) -> str:
    lines = ["shared protocol against FL-bench (pfedkit key = value | FL-bench key value | note):"]
    lines += [f"  {s.pfedkit_key} = {s.pfedkit_value} | {s.flbench_key or '-'} {s.flbench_value} | {s.note}"
              for s in FLBENCH_PROTOCOL]
    lines.append("  fixed on FL-bench's side: " + " ".join(f"{k}={v}" for k, v in FLBENCH_FIXED.items()))
    for m in [method] if method else FLBENCH_METHODS.values():
        options = " ".join(f"{k}={v}" for k, v in m.pfedkit_options.items())
        flags = " ".join(f"++{k}={v}" for k, v in m.flbench_options.items())
        lines.append(f"{m.label}: pfedkit algorithm={m.pfedkit} {options} | FL-bench method={m.flbench} {flags}")
        lines += [f"  departure: {d}" for d in m.departures]
    if method is None:
        lines += [f"{label}: not comparable: {why}" for label, why in FLBENCH_NOT_COMPARABLE.items()]
    return "\n".join(lines)
