"""The methods of the conformance rows against FL-bench, and those FL-bench's code does not let a row check.

FLBENCH_METHODS: per method, pfedkit's algorithm and options, FL-bench's method and overrides, where
FL-bench's curve of the method's evaluated model is read (`curve`, `round_shift`), and every departure
the options cannot remove (file and line in FL-bench at flbench_mapping.FLBENCH_COMMIT). Where the two
defaults differ, both sides take FL-bench's unless that switches a term of the method off.
FLBENCH_NOT_COMPARABLE: FL-bench methods that do not compute the paper's method under this protocol
(a bug or another reading, with file and line): the runner refuses them with the reason.
"""
from __future__ import annotations

from flbench_mapping import FlbenchMethod


def fedopt_method(label: str, server: str) -> FlbenchMethod:
    """FedAdam, FedYogi or FedAdagrad against FL-bench's one `fedopt` method (++fedopt.type = `server`, chosen at
    src/server/fedopt.py:29-36), at FL-bench's defaults on both sides: server lr 0.1, beta1 0.9, tau 1e-3, v_0 = 0
    (beta2 0.999 for Adam and Yogi; FL-bench reads it but Adagrad does not use it, :112-114)."""
    name = label.lower()
    shared = {"server_lr": 0.1, "beta1": 0.9, "tau": 0.001}
    second_moment = {} if server == "adagrad" else {"beta2": 0.999}
    pfedkit = {f"{name}.{k}": v for k, v in {**shared, **second_moment, "initial_v": 0.0}.items()}
    flbench = {"fedopt.type": server, **{f"fedopt.{k}": v for k, v in {**shared, **second_moment}.items()}}
    defaults = ("FL-bench's defaults are server lr 0.1, beta1 0.9, beta2 0.999 and tau 1e-3 (src/server/fedopt.py:"
                "22-25); pfedkit's differ (FedAdam and FedYogi: server lr 0.01, beta2 0.99; FedAdagrad: beta1 0, "
                "which "
                "switches off the first moment FL-bench applies to Adagrad too (:100-101), tau 1e-2): both sides "
                "take "
                "FL-bench's")
    return FlbenchMethod(label, name, "fedopt", pfedkit, flbench, departures=(
        defaults,
        "FL-bench starts v at 0 (src/server/fedopt.py:78-81); Reddi et al.'s Algorithm 2 asks v_{-1} >= tau^2 "
        "(pfedkit's default): pfedkit's initial_v=0 follows FL-bench",
        "FL-bench's Delta is the n_i-weighted mean of y_i - x (src/server/fedopt.py:50-54, 91-97), as pfedkit's; "
        "Algorithm 2 writes the uniform mean, the same here (every client holds 480 training rows); FL-bench "
        "averages the diffs, pfedkit takes mean - x: float rounding only",
        "the updates agree term by term: m = beta1 m + (1 - beta1) Delta (:100-101); v by Adam's, Yogi's or "
        "Adagrad's "
        "rule (:112-123); x += lr m / (sqrt(v) + tau) (:107-110); no bias correction on either side"))

def cfl_method(label: str, eps1: float, eps2: float, start_epoch: int) -> FlbenchMethod:
    """CFL at the given thresholds, splitting from FL-bench's 0-based epoch `start_epoch` on. "CFL" takes
    FL-bench's defaults, under which no cluster splits in 25 rounds on this split (every client's update
    norm stays below 0.43 < eps2 = 1.6): CFL is FedAvg there. "CFL-split" takes thresholds read off a
    pfedkit run (seed 0: mean / max update norm 0.17 / 0.26 at round 9, max 0.23 at round 10) so that
    one split of all clients happens at round 9 and no later one (the one FL-bench splits right)."""
    return FlbenchMethod(label, "cfl", "cfl",
                         {"cfl.eps1": eps1, "cfl.eps2": eps2, "cfl.warmup": start_epoch + 1, "cfl.min_cluster_size": 2,
                          "cfl.update_weighting": "uniform"},
                         {"cfl.eps_1": eps1, "cfl.eps_2": eps2, "cfl.min_cluster_size": 2,
                          "cfl.start_clustering_round": start_epoch},
                         departures=(
        "warm-up: FL-bench may split from its epoch start_clustering_round (0-based, src/server/cfl.py:59), "
        "pfedkit from round warmup (1-based): warmup = start_clustering_round + 1",
        "FL-bench keeps a model per client and adds its cluster's mean update to each member "
        "(src/server/cfl.py:14, 95-112): members of a cluster hold the same model, pfedkit's cluster model; "
        "the mean is uniform (:103), pfedkit update_weighting=uniform (the same as n_i here: 480 rows each)",
        "FL-bench's bi-partition returns positions inside the split cluster (np.argwhere(labels_ == k), "
        "src/server/cfl.py:84-90) and stores them as client ids (:61-64): right for a cluster whose members "
        "are clients 0..k-1 (the first split of everyone), wrong for a later split of any other cluster; "
        "pfedkit maps positions back to clients. Where a run splits more than once the sides can differ",
        "complete linkage on -cos (scikit-learn, precomputed) against pfedkit's 1 - cos (scipy): the same "
        "tree (a constant shift); which half keeps the old index is labelling only"))


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
                              "(src/server/fedavgm.py:37-49, weights len(trainset), "
                              "src/client/fedavg.py:178,194-199); "
                              "pfedkit's is x - sum p_i y_i: the same up to float rounding",)),
    *(fedopt_method(label, server) for label, server in (("FedAdam", "adam"), ("FedYogi", "yogi"),
                                                        ("FedAdagrad", "adagrad"))),
    FlbenchMethod("pFedHN", "pfedhn", "pfedhn",
                  {"pfedhn.inner_steps": 25, "pfedhn.embed_dim": 5, "pfedhn.server_steps": "per_client"},
                  {"pfedhn.version": "pfedhn", "pfedhn.embed_dim": 5, "common.buffers": "local"}, curve="clients",
                  departures=(
                      "FL-bench trains E = 5 epochs; pfedkit's pFedHN always trains a fixed number of mini-batches "
                      "(Fit(steps=inner_steps)): inner_steps = 25 = 5 epochs x 5 batches (100,100,100,100,80) of "
                      "every "
                      "client's 480 training rows, drawn epoch by epoch with drop_last=false, as FL-bench's "
                      "DataLoader",
                      "FL-bench's default embedding size is int((1 + N) / 4) = 5 (src/server/pfedhn.py:123), "
                      "pfedkit's "
                      "int(1 + N / 4) = 6: both set to 5; H 100, 3 hidden layers, hn_lr 1e-2, embed_lr = hn_lr, "
                      "momentum "
                      "0.9, weight decay 1e-3 on every tensor, clip 50 are both sides' defaults "
                      "(src/server/pfedhn.py:21-31, "
                      "53-74, 103-106)",
                      "FL-bench trains a round's clients one after another, each from the model the hypernetwork "
                      "generates "
                      "after the previous client's step (src/server/pfedhn.py:76-106; package() per client at "
                      "src/utils/trainer.py:42-44), the paper's one-client-per-step algorithm; pfedkit's "
                      "participants all train from phi^t's models and the steps follow, each VJP at the current phi "
                      "(pfedkit/algorithms/pfedhn.py:183-184). pfedkit with one participant a round (join_ratio = "
                      "1/N, N times the rounds, eval_every N) is the paper's algorithm: its curve is FL-bench's "
                      "(docs/conformance.md)",
                      "FL-bench steps in the round's random.sample order (src/server/fedavg.py:122-128, 468), "
                      "pfedkit in "
                      "ascending client id",
                      "FL-bench's 'before' is h(v_i; phi) generated at the client's turn "
                      "(src/server/pfedhn.py:108-117), the "
                      "generated model the paper evaluates but after the round's earlier clients' steps; pfedkit "
                      "evaluates "
                      "h(v_i; phi) after all of the previous round's steps for every client (evaluated_model custom, "
                      "after_download): only FL-bench's first client of a round sees the same phi",
                      "train_one_round leaves self.selected_clients = [the round's last client] "
                      "(src/server/pfedhn.py:79) and "
                      "display_metrics pools self.selected_clients (src/server/fedavg.py:729-734): metrics.csv's "
                      "accuracy_test_before is ONE client's 120 test rows per epoch; the 20-client pool must be "
                      "rebuilt from "
                      "main.log's per-client lines (src/utils/trainer.py:47-50, verbose_gap=1): the mean of the 20 "
                      "'before' "
                      "test accuracies (equal 120-row test sets = sample-weighted)",
                      "FL-bench's pFedHN refuses common.buffers=global (src/server/pfedhn.py:37-38), which "
                      "FLBENCH_FIXED sets: "
                      "++common.buffers=local comes later on the command line and wins (hydra applies overrides in "
                      "order); "
                      "FedAvgCNN has no buffers, so no number changes",
                  )),
    FlbenchMethod("CCVR", "ccvr", "ccvr",
                  {"ccvr.calibration": "every_round", "ccvr.virtual_per_class": 200, "ccvr.calibration_epochs": 1,
                   "ccvr.calibration_lr": "LR", "ccvr.calibration_batch_size": "B"},
                  {"ccvr.sample_per_class": 200, "common.test.client.interval": 1}, curve="test_results",
                  round_shift=1,
                  departures=(
                      "FL-bench calibrates only inside test_client_models (src/server/ccvr.py:25-29), which runs "
                      "only when "
                      "common.test.client.interval > 0 (src/server/fedavg.py:481-485). With the protocol's -1 it is "
                      "FedAvg. "
                      "The row sets ++common.test.client.interval=1, which overrides the fixed -1 because hydra "
                      "applies overrides in order",
                      "FL-bench's metrics.csv 'accuracy_test_before' is always the uncalibrated global model, i.e. "
                      "FedAvg "
                      "(src/client/fedavg.py:101). The calibrated model's accuracy "
                      "(test_results[e+1]['all_clients']['before']['test'], "
                      "pooled) is only in main.log's closing JSON (src/server/fedavg.py:978-1010), as 2-decimal "
                      "percent strings",
                      "FL-bench's test after epoch e calibrates the model just aggregated (e+1 aggregations); "
                      "pfedkit's round r evaluates "
                      "the calibrated model the round started from (r-1 aggregations): FL-bench's key k is pfedkit's "
                      "round k+1, and "
                      "pfedkit's round 1 (the calibrated initial model) has no FL-bench counterpart",
                      "FL-bench's client covariance is cov(correction=0), 1/N_ck (src/client/ccvr.py:34), but it is "
                      "pooled with the "
                      "1/(N_ck - 1) formula (src/server/ccvr.py:58-69). Its class covariance is then not the "
                      "union's: the within-client "
                      "scatter shrinks by (N_ck - 1)/N_ck, about 0.9 for a minority class with about 10 rows here. "
                      "pfedkit follows the paper's "
                      "eq. (2) and has no option for FL-bench's reading",
                      "sampling: FL-bench uses np.random.multivariate_normal on numpy's global RNG "
                      "(src/server/ccvr.py:79-83), "
                      "pfedkit an eigendecomposition with a seeded torch generator; same distribution, different "
                      "draws",
                      "re-training: FL-bench runs one epoch of plain SGD on the classifier from the global one, at "
                      "optimizer.lr and "
                      "common.batch_size with shuffle and the last batch kept, softmax over all classes "
                      "(src/server/ccvr.py:115-132). "
                      "pfedkit's options match it: 200 per class, 1 epoch, lr LR, batch B; pfedkit's defaults are "
                      "100, 10, 0.01, 32. "
                      "pfedkit's softmax covers only the calibrated classes, which is the same here because every "
                      "class has data",
                      "statistics come from all train clients in FL-bench (src/server/ccvr.py:33-35) and from the "
                      "round's "
                      "participants in pfedkit; with join_ratio 1 these are the same clients",
                      "FL-bench's test path draws from torch's global RNG (the trainloader shuffles in the feature "
                      "pass, the "
                      "virtual-feature DataLoader) and from numpy's, so its training batches differ from its FedAvg "
                      "run at the same seed",
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
                              "(common.test.client.interval > 0, src/server/fedavg.py:481-485, 532-560: every "
                              "client, "
                              "the model after E+1 aggregations, stored as "
                              "test_results[E+1]['all_clients']['before'] "
                              "and printed to main.log at the end, :978-1011), never in metrics.csv (:902-926)",
                              "k: FL-bench's default 5 (src/server/knnper.py:19), pfedkit's 7 (the authors' "
                              "scripts); "
                              "both set to 5; weight/lam 0.5 and scale/sigma 1 are both defaults",
                              "FL-bench mixes p_kNN with the raw logits, weight * p_kNN + (1 - weight) * z "
                              "(src/client/knnper.py:73-76), as the authors' code; the paper mixes probabilities: "
                              "pfedkit's interpolate=logits reproduces FL-bench (its default is the paper's)",
                              "datastore model: both embed the training rows with the very model they evaluate, "
                              "rebuilt at each evaluation (src/client/knnper.py:46-50, 68-71; pfedkit's "
                              "evaluation_state), as the paper. Until 2026-11-29 pfedkit embedded them with the "
                              "model downloaded in the client's latest round, one aggregation older than its "
                              "queries: rounds 1-4 were 30 to 2 points below FL-bench's",
                              "capacity 500 is compared with the number of batches, len(features) "
                              "(src/client/knnper.py:121,124): 5 batches here, so all 480 rows are stored, as pfedkit",
                              "kernel: both exp(-||phi(x) - phi(x_j)||^2 / (d sigma)), d = 512, squared L2 "
                              "(src/client/knnper.py:96-98, faiss IndexFlatL2 :117); FL-bench divides by sum + 1e-9 "
                              "(:106-108), pfedkit takes the weights relative to the nearest neighbour: the same "
                              "distribution unless every weight underflows in float32 (squared distance > ~5e4)",
                              "FL-bench's kNNPerClient builds faiss.IndexFlatL2 in its constructor "
                              "(src/client/knnper.py:34, 117): with flbench_run.py's raising faiss stub the run "
                              "fails "
                              "at client creation even with interval=-1; it needs the real faiss-cpu "
                              "(.env/requirements.txt:2 pins 1.9.0)")),
    FlbenchMethod("pFedSim", "pfedsim", "pfedsim", {"pfedsim.warmup": 0.5},
                  {"pfedsim.warmup_round": 12, "common.test.client.interval": 1},
                  curve="test_results",
                  departures=("warm-up length: FL-bench reads warmup_round <= 1 as a share of its common.global_epoch = "
                              "R + 1 epochs (src/server/pfedsim.py:25-28: int(26 * 0.5) = 13 FedAvg rounds), pfedkit "
                              "as "
                              "a share of R (int(25 * 0.5) = 12); FL-bench gets the count 12 (a value in (1, "
                              "global_epoch) "
                              "is a round count, :29-30), which is right for R = 25 only",
                              "the model evaluated after the warm-up: FL-bench's accuracy_test_before of epoch e > "
                              "12 is "
                              "the personalised download, the client's stored head + the -log(1 - S)-weighted mean "
                              "of "
                              "epoch e-1's trained bodies (get_client_model_params, src/server/pfedsim.py:104-133, "
                              "evaluated before fit, src/client/fedavg.py:101); pfedkit evaluates each client's own "
                              "stored trained model, unmixed (client_model), which is FL-bench's accuracy_test_after "
                              "of "
                              "epoch e-1 (src/client/fedavg.py:102-104) and what FL-bench's own test path evaluates "
                              "(testing=True returns the stored model, src/server/pfedsim.py:107-111): from round 13 "
                              "on "
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
                              "vertices and discards that pass (src/server/floco.py:47-55); pfedkit projects the "
                              "vertices "
                              "its round-tau participants uploaded (trained from the global after tau - 1 "
                              "aggregations), "
                              "with no extra pass: with tau = projection_round = 10 both train in subregions from "
                              "the "
                              "global after 10 aggregations on and evaluate at the points from round 10 on, but the "
                              "points come from models one round apart (the authors' Flower baseline, like pfedkit, "
                              "takes them from a regular round's uploads)",
                              "vertex initialisation: both draw every vertex Xavier-normal under the seed seed + m "
                              "(src/server/floco.py:119-120, 188-192; pfedkit's default vertex_init=xavier_normal, "
                              "the same tensors); with --init flbench the body is FL-bench's too",
                              "FL-bench's SimplexLinear keeps nn.Linear's own weight as a registered parameter that "
                              "the "
                              "`weight` property shadows (src/server/floco.py:114-125): never used in the forward "
                              "pass, it "
                              "gets no gradient and is averaged unchanged; the bias is a fresh nn.Linear bias "
                              "(:88-94), "
                              "PyTorch's default as pfedkit's",
                              "PCA: scikit-learn's PCA(n_components=10) of the float32 signatures "
                              "(src/server/floco.py:"
                              "139-140) takes the 'randomized' solver for a 20 x 51,200 matrix (scikit-learn 1.9.1: "
                              "max(shape) > 500 and 10 < 0.8 * 20), drawing from numpy's global RNG; its 10 + 10 "
                              "oversamples span the centred matrix (rank <= 19), so the scores are the exact SVD's "
                              "up to "
                              "float32 rounding; pfedkit: exact SVD in float64, same sign rule (largest |loading| "
                              "positive)")),
    FlbenchMethod("FedProx", "fedprox", "fedprox", {"fedprox.mu": 1.0}, {"fedprox.mu": 1.0},
                  departures=("FL-bench's effective default mu is 0.01 (config/defaults.yaml:143-144, kept by parse_args "
                              "over get_hyperparams' 1.0, src/server/fedprox.py:16, "
                              "src/utils/functional.py:157-165); "
                              "pfedkit's is 0.01: both set to FedReMa's mu = 1, as the PFLlib row",
                              "FL-bench adds mu (w - w^t) to the gradient after backward, w^t the received model "
                              "cloned "
                              "before training (src/client/fedprox.py:11,22-24): the gradient of pfedkit's "
                              "(mu/2)||w - w^t||^2 loss term, the same step")),
    FlbenchMethod("FedLC", "fedlc", "fedlc", {"fedlc.tau": 1.0, "fedlc.counts": "client", "fedlc.denominator": "all"},
                  {"fedlc.tau": 1.0},
                  departures=("FL-bench's loss is -log(e^{z_y - m_y} / sum_c e^{z_c - m_c}), m_c = tau n_{i,c}^{-1/4} "
                              "from the client's own training counts, every class in the denominator "
                              "(src/client/fedlc.py:13-34; tau default 1, src/server/fedlc.py:25): pfedkit's "
                              "counts=client, "
                              "denominator=all, tau=1 (all its defaults; the PFLlib row takes counts=global); the "
                              "paper's "
                              "printed denominator leaves the true class out (FL-bench's note, "
                              "src/server/fedlc.py:6-13)",
                              "an absent class gets count 1e-8, a margin of 100 tau, in FL-bench "
                              "(src/client/fedlc.py:17), "
                              "+inf in pfedkit: it does not arise here, every client holds every class (at least 5 "
                              "training "
                              "rows of each for seeds 0-2)",
                              "FL-bench exponentiates and takes the log of the ratio without subtracting the maximum "
                              "(src/client/fedlc.py:23-34): it overflows to inf/NaN for a calibrated logit above ~88 "
                              "in "
                              "float32, where pfedkit's F.cross_entropy (log-softmax) does not; otherwise the same "
                              "numbers "
                              "up to rounding (pfedkit's margins are taken relative to the smallest, which the "
                              "softmax "
                              "ignores)")),
    FlbenchMethod("FedDyn", "feddyn", "feddyn", {"feddyn.alpha": 0.1, "feddyn.client_alpha": "equal"},
                  {"feddyn.alpha": 0.1, "optimizer.weight_decay": 0.1, "feddyn.max_grad_norm": 1.0e9},
                  departures=("FL-bench's default alpha is 0.1 (src/server/feddyn.py:23), pfedkit's 0.01: both set to "
                              "FL-bench's (the PFLlib row used 1)",
                              "FL-bench's local loss is CE + alpha <theta, nabla_i - x> (src/client/feddyn.py:30-32, "
                              "src/server/feddyn.py:34-36), gradient g + alpha (nabla_i - x), with no alpha theta: "
                              "the "
                              "quadratic pull of the paper's (alpha/2)||theta - x||^2 is missing; FL-Simulator, "
                              "which the "
                              "file follows (src/server/feddyn.py:13), and the authors' code supply alpha theta "
                              "through SGD "
                              "weight decay alpha, which FL-bench does not port; optimizer.weight_decay = alpha "
                              "restores it "
                              "(torch SGD adds alpha theta in step), giving g - g_k + alpha (theta - x) with "
                              "g_k = -alpha nabla_i (nabla_i += y_i - x, src/server/feddyn.py:47-50): pfedkit's "
                              "feddyn_loss",
                              "FL-bench clips the gradient norm at max_grad_norm = 10 (src/server/feddyn.py:24, "
                              "src/client/feddyn.py:35-37) before the step adds the weight-decay term, so it clips "
                              "g - g_k - alpha x; pfedkit's grad_clip would clip the whole g - g_k + alpha (theta - "
                              "x), another "
                              "vector: clipping off on both sides (max_grad_norm 1e9, pfedkit grad_clip null); not "
                              "the paper's",
                              "FL-bench's server model is the n_i-weighted mean of the uploads plus the mean over "
                              "ALL N clients "
                              "of nabla (src/server/feddyn.py:42,52-54), i.e. the paper's (4) with h = -alpha mean "
                              "nabla: "
                              "pfedkit's uniform mean - h/alpha; equal n_i here (480), so float rounding only",
                              "at this commit FL-bench uses one alpha for every client (src/client/feddyn.py:32) and "
                              "indexes "
                              "nabla by client id (src/server/feddyn.py:47-50): pfedkit's client_alpha=equal "
                              "(by_size is the "
                              "same here, equal n_i)")),
    FlbenchMethod("MOON", "moon", "moon", {"moon.mu": 5.0, "moon.tau": 0.5}, {"moon.mu": 5.0, "moon.tau": 0.5},
                  departures=(
                      "mu: FL-bench's default is 5 (src/server/moon.py:19; the paper's CIFAR-10 value), pfedkit's 1 "
                      "(FedReMa's, and the PFLlib row's); both set to FL-bench's 5, which weighs the contrastive "
                      "term more "
                      "and so tests it harder; tau 0.5 is both defaults (src/server/moon.py:18)",
                      "FL-bench computes z_glob and z_prev per mini-batch from frozen copies left in train mode "
                      "(src/client/moon.py:13-14, 33-35); pfedkit computes them once per round for every training "
                      "row in "
                      "eval mode: the same numbers for FedAvgCNN, which has no BatchNorm or dropout",
                      "previous model before a client's first participation: FL-bench the received global "
                      "(src/client/moon.py:19-22), pfedkit the initial model; the same here, since every client "
                      "trains in "
                      "round 1 (global = initial, l_con = log 2 with zero gradient on both sides)",
                      "l_con: FL-bench -log(e^a / (e^b + e^a)) written out (src/client/moon.py:38-53), pfedkit "
                      "logaddexp(a, b) - a; equal up to float rounding (|a|, |b| <= 1/tau = 2)",
                      "representation: both the body output, get_last_features = base = conv1..fc1 + ReLU, 512-d "
                      "(src/utils/models.py:69-94, 153-165) = pfedkit's cnn body; neither builds the paper's 2-layer "
                      "projection head",
                  )),
    FlbenchMethod("Ditto", "ditto", "ditto", {"ditto.lam": 1.0, "ditto.personal_epochs": 1},
                  {"ditto.lamda": 1.0, "ditto.pers_epoch": 1},
                  departures=("lam and plocal: FL-bench's defaults lamda = 1, pers_epoch = 1 (src/server/ditto.py:19-20) are "
                              "pfedkit's (ditto.lam = 1, ditto.personal_epochs = 1); set explicitly on both sides",
                              "order: FL-bench trains the global model E epochs first, then the personal model "
                              "(src/client/ditto.py:34-44, 46-60); pfedkit trains the personal model first (PFLlib's "
                              "order, "
                              "docs/algorithms/ditto.md 'ours'). Both anchor the proximal term at the received w^t "
                              "(FL-bench "
                              "keeps the package's global tensors, src/client/ditto.py:17-20, which load_state_dict "
                              "copies from "
                              "and training never touches), so only the order of the batch draws differs",
                              "proximal term: FL-bench adds lamda (v - w^t) to each personal gradient before the "
                              "step "
                              "(src/client/ditto.py:53-59), the gradient of pfedkit's (lam/2)||v - w^t||^2 "
                              "(pfedkit/algorithms/fedprox.py:22-27): the same update",
                              "optimisers: FL-bench has one SGD with two param groups, the model and the personal "
                              "model "
                              "(src/client/ditto.py:11-13), pfedkit two slots; with plain SGD (no momentum, no "
                              "weight decay) "
                              "and zero_grad leaving the idle group's grads None, the same updates",
                              "FL-bench's personal loop does not skip a batch of one sample "
                              "(src/client/ditto.py:47-48, the "
                              "global loop does, :36-37): no batch of one here (480 rows, B = 100)",
                              "evaluated model: FL-bench's 'before' is the client's personal model v_i as stored "
                              "after its "
                              "previous round (DittoClient.evaluate evaluates pers_model, src/client/ditto.py:65-66; "
                              "stored by "
                              "the server, src/server/ditto.py:29-42), the paper's evaluated model and pfedkit's "
                              "(client_model = personal, after_download); epoch 0: every v_i is the initial model "
                              "(src/server/ditto.py:25-27), as pfedkit's init_client")),
    FlbenchMethod("FedRep", "fedrep", "fedrep", {"fedrep.head_epochs": 4, "fedrep.body_epochs": 1},
                  {"fedrep.train_body_epoch": 1},
                  departures=("epochs: FL-bench splits the E = common.local_epoch epochs, the first E - train_body_epoch "
                              "training the head (base grads zeroed) and the last train_body_epoch the body "
                              "(classifier grads "
                              "zeroed) (src/client/fedrep.py:11-25; default train_body_epoch 1, "
                              "src/server/fedrep.py:16): "
                              "4 head + 1 body epochs here, the authors' structure (--local_ep 11 --local_rep_ep 1) "
                              "with "
                              "4 instead of 10 head epochs. pfedkit's defaults are 10 head + local_epochs = 5 body "
                              "epochs; "
                              "both set to FL-bench's 4 + 1 (head first, then body, as Algorithm 1)",
                              "issue #164 (the whole model uploaded and averaged) still holds at this commit: the "
                              "client "
                              "uploads every parameter (regular_params_name, src/client/fedavg.py:37, 180-182) and "
                              "the server "
                              "averages the classifier too (src/server/fedavg.py:677-702), but the client's own "
                              "head, stored "
                              "from personal_model_params (FedPerClient: names with 'classifier', "
                              "src/client/fedper.py:7-9; "
                              "src/utils/trainer.py:54-56), is loaded over the received one "
                              "(src/client/fedavg.py:143-144), "
                              "so the averaged head is never used. The only exposure is a client's first "
                              "participation, when "
                              "nothing is stored and it starts from the averaged head; with every client in epoch 0 "
                              "that is "
                              "the initial head, as pfedkit's: no number changes here (it would under partial "
                              "participation)",
                              "freezing: FL-bench zeroes the frozen part with Module.zero_grad (grads None, skipped "
                              "by the "
                              "step) after a full backward pass, pfedkit trains with trainable=head/body; with plain "
                              "SGD "
                              "(no momentum, no weight decay) the same updates; FL-bench uses one optimizer for both "
                              "phases, "
                              "pfedkit two slots (head, body): stateless here",
                              "evaluated model: FL-bench's 'before' is the received body (after e aggregations) + "
                              "the "
                              "client's stored head, the paper's evaluated model and pfedkit's (shared_body, "
                              "after_download)")),
    FlbenchMethod("FedPer", "fedper", "fedper",
                  departures=("FL-bench uploads and averages the classifier with the body (every parameter is 'regular', "
                              "src/client/fedavg.py:37, 180-182; src/server/fedavg.py:677-702), but the client's "
                              "stored "
                              "head (personal: names containing 'classifier', src/client/fedper.py:7-9; stored by "
                              "src/utils/trainer.py:54-56) is loaded over the received one "
                              "(src/client/fedavg.py:143-144): "
                              "the averaged head is never used (FL-bench issue #164); in epoch 0 every client starts "
                              "from "
                              "the initial head, as pfedkit's init_client, so no number changes",
                              "evaluated model: FL-bench's 'before' is the received body (after e aggregations) + "
                              "the "
                              "client's stored head, the paper's personalised model and pfedkit's (shared_body, "
                              "after_download)")),
    FlbenchMethod("FedBABU", "fedbabu", "fedbabu", {"fedbabu.finetune_epochs": 0},
                  {"common.test.client.finetune_epoch": 5},
                  departures=("FL-bench's FedBABU refuses to start with common.test.client.finetune_epoch = 0 "
                              "(src/server/fedbabu.py:14-17), which FLBENCH_FIXED sets: the row gives it 5 "
                              "(pfedkit's "
                              "default tau_f); with common.test.client.interval = -1 test_client_models never runs "
                              "(src/server/fedavg.py:481-485), so nothing is fine-tuned and the training draws are "
                              "FedAvg's",
                              "evaluated model: FL-bench's 'before' (metrics.csv) is the received global body + the "
                              "fixed "
                              "head, un-fine-tuned (FedAvgClient.train_with_eval, src/client/fedavg.py:101); "
                              "FL-bench "
                              "fine-tunes only in its test path (FedAvgClient.test/finetune, "
                              "src/client/fedavg.py:284-335, "
                              "the whole model, finetune_epoch epochs) and stores that as test_results[k]['after']. "
                              "The paper "
                              "evaluates the fine-tuned model (pfedkit's default finetune_epochs = 5); here both "
                              "sides "
                              "evaluate the un-fine-tuned global model (pfedkit's finetune_epochs = 0), as the "
                              "PFLlib row",
                              "fixed head: FL-bench zeroes the classifier's grads in place before each step "
                              "(src/client/fedbabu.py:21-24) and, the head being a regular parameter, averages the "
                              "20 "
                              "unchanged heads every round (src/server/fedavg.py:677-702): n_i weights 0.05 in "
                              "float32 move "
                              "it by up to 1.5e-8 over 25 rounds (checked); pfedkit never trains or averages it "
                              "(trainable=body, server averages bodies): rounding only")),
    FlbenchMethod("FedBABU-finetuned", "fedbabu", "fedbabu", {"fedbabu.finetune_epochs": 5, "fedbabu.finetune_part": "all"},
                  {"common.test.client.finetune_epoch": 5, "common.test.client.interval": 1}, curve="test_results_after",
                  departures=("the paper's evaluated model: each client fine-tunes the received global model (body and "
                              "head) for 5 epochs and is evaluated with it. FL-bench does it only in its test path "
                              "(FedAvgClient.test/finetune, src/client/fedavg.py:284-335: a copy, the client's SGD "
                              "at the "
                              "run's lr, batches of B shuffled, the last batch kept, a batch of one skipped; "
                              "FedBabuClient "
                              "has no finetune of its own), after each epoch on the global model after k "
                              "aggregations: "
                              "test_results[k]'s 'after' side, pfedkit's round k (fedbabu.finetune_epochs=5, "
                              "finetune_part=all: a fresh plain SGD on a copy, nothing written back)",
                              "FL-bench's test-path fine-tuning draws its batches from torch's global RNG, so its "
                              "training "
                              "batches differ from the plain FedBABU row's at the same seed (the same distribution)",
                              "training as the FedBABU row: body trained, head fixed (FL-bench zeroes its grads, "
                              "src/client/fedbabu.py:21-24, and averages the unchanged heads: rounding only)")),
    FlbenchMethod("Per-FedAvg", "perfedavg", "perfedavg",
                  {"perfedavg.variant": "fo", "perfedavg.beta": 0.001, "perfedavg.eval_epochs": 1,
                   "local_steps": "PAIRED_BATCHES"},
                  {"perfedavg.version": "fo", "perfedavg.beta": 0.001, "common.test.client.finetune_epoch": 1,
                   "common.test.client.interval": 1}, curve="test_results_after",
                  departures=("evaluation: FL-bench forces a test-path fine-tune of at least one epoch "
                              "(src/server/perfedavg.py:25) and evaluates after it (FedAvgClient.test/finetune, "
                              "src/client/fedavg.py:284-335: plain SGD at the run's lr on a copy, every batch of "
                              "one shuffled epoch): test_results[k]'s 'after' side is pfedkit's round k with "
                              "perfedavg.eval_epochs=1 (one epoch of inner steps at lr alpha = the run's lr); "
                              "the paper and PFLlib evaluate after one step on one batch (pfedkit's default)",
                              "local training: FL-bench takes floor(b / 2) first-order meta steps an epoch, "
                              "batch pairs drawn from one iterator that runs on across epochs "
                              "(src/client/perfedavg.py:28-33, 85-93): 2 E floor(b / 2) consecutive batches of "
                              "reshuffled epochs, 20 on this split (5 batches of 480 rows); pfedkit local_steps = "
                              "that count gives the same pairs of its schedule (10 meta steps)",
                              "inner step with the client's SGD (lr 0.01, no momentum here), outer step with a "
                              "plain SGD of lr beta = 1e-3 (src/client/perfedavg.py:14-16, 36-82): pfedkit's FO "
                              "step, beta = 1e-3 on both (FL-bench's default and pfedkit's)",
                              "aggregation: FL-bench weights every client 1 (src/client/perfedavg.py:22-25), "
                              "pfedkit by n_i: the same here (every client holds 480 training rows)")),
    cfl_method("CFL", 0.4, 1.6, 20),
    cfl_method("CFL-split", 0.25, 0.24, 8),
    FlbenchMethod("FedProto", "fedproto", "fedproto",
                  {"fedproto.lam": 1.0, "fedproto.prediction": "head", "fedproto.global_feature_weighting": "uniform",
                   "fedproto.regulariser": "sample_mse"},
                  {"fedproto.lamda": 1.0},
                  departures=(
                      "evaluation: FL-bench has no nearest-prototype prediction; FedProtoClient keeps "
                      "FedAvgClient.evaluate, "
                      "so accuracy_test_before is the client's own model predicting with its own head (every "
                      "parameter is "
                      "personal, src/client/fedproto.py:19; loaded in set_parameters, src/client/fedavg.py:143-144); "
                      "the "
                      "paper, PFLlib and pfedkit's default predict by the nearest global prototype; pfedkit's "
                      "prediction=head evaluates FL-bench's model, so this row checks FedProto's training, not its "
                      "inference",
                      "uploaded prototypes: FL-bench accumulates the features of every training batch of all E "
                      "epochs, each "
                      "from the model before that step, in train mode (process_features, "
                      "src/client/fedproto.py:61-63, 78-85), "
                      "and uploads their class means (:38-42), as FedProto's own code does; pfedkit (and PFLlib) "
                      "take one "
                      "eval-mode pass with the trained model after training; no pfedkit option gives FL-bench's "
                      "reading, and "
                      "it changes the global prototypes every round (the features of early epochs weigh 4/5)",
                      "server: FL-bench's plain mean over the uploading clients, rebuilt each round "
                      "(src/server/fedproto.py:"
                      "38-51) = pfedkit's uniform weighting; pfedkit keeps a class nobody uploaded, FL-bench drops "
                      "it: the "
                      "same with every client in every round",
                      "loss: both CE + lam * MSE(f(x), C_y) averaged over B x d, a sample of a class without a "
                      "global "
                      "prototype targeting its own feature (0, counted in the mean; src/client/fedproto.py:64-69, "
                      "86-87); "
                      "round 1 is plain CE on both (no prototypes yet); lamda 1 is both defaults "
                      "(src/server/fedproto.py:20); "
                      "FL-bench's F.relu on the base output (:61) is the identity (the base ends with ReLU)",
                      "no model aggregation on either side: FL-bench's train_one_round aggregates prototypes only "
                      "(src/server/fedproto.py:32-36), each client trains its own model from the initial one",
                  )),
    FlbenchMethod("FedPAC", "fedpac", "fedpac", {"fedpac.lam": 1.0, "fedpac.head_epochs": 1, "fedpac.head_lr": 0.1},
                  {"fedpac.lamda": 1.0, "fedpac.train_classifier_round": 1, "fedpac.classifier_lr": 0.1,
                   "common.local_epoch": 6},
                  departures=(
                      "epochs: FL-bench's head epoch is one of common.local_epoch (epoch index < "
                      "train_classifier_round "
                      "trains the head, the rest the body, src/client/fedpac.py:102-140), so E = 5 would give 1 head "
                      "+ 4 body "
                      "epochs; the authors' code (JianXu95/FedPAC methods/fedpac.py: local_epoch = epoch_classifier "
                      "+ "
                      "local_ep_rep), PFLlib and pfedkit run 1 head + E body epochs: FL-bench gets "
                      "common.local_epoch = E + 1 "
                      "= 6 (a literal, right for E = 5 only)",
                      "head lr: FL-bench's classifier_lr default 0.1 (src/server/fedpac.py:25, param groups "
                      "src/client/fedpac.py:26-34; the authors' lr_g = 0.1), pfedkit's head_lr default None = the "
                      "config's "
                      "lr 0.01: both set to 0.1",
                      "alignment target without a global centroid: FL-bench pulls the sample to the client's local "
                      "prototype "
                      "of its class, computed with the received model before training (src/client/fedpac.py:101, "
                      "124-135; "
                      "local_prototypes[label] != [] is True for a tensor), and applies the term in every round, so "
                      "round 1 "
                      "(no global centroid yet) already aligns to local prototypes; the authors' code skips the term "
                      "in "
                      "round 0 (if round > 0) and pfedkit gives 0 in round 1 and for classes without a centroid; "
                      "with every "
                      "client in every round each class a client holds has a centroid from round 2 on, so only round "
                      "1 "
                      "differs; no pfedkit option gives FL-bench's reading",
                      "QP: FL-bench builds diag(V) + D_i in float32 (src/server/fedpac.py:79-105), solves it with "
                      "cvxpy's "
                      "default QP solver, iterative, to its tolerance (calculate_classifier_weights, :147-156; "
                      "DCPError -> own "
                      "head), projects to eigenvalues >= 0.01 only when a strict float32 eigvalsh test fails "
                      "(:107-125); "
                      "pfedkit solves exactly (NNLS, float64, rounding tolerance 1e-10 max diag): the same weights "
                      "up to the "
                      "solver's tolerance (here diag(V) > 0 makes the matrix positive definite, so both take the "
                      "direct "
                      "path); weights < 1e-3 are zeroed and renormalised on both (:153, :128)",
                      "statistics V_i and h_i: the same formulas (1/n_i, pi_c mu_c) from the received model before "
                      "training "
                      "(set_parameters -> extract_stats, src/client/fedpac.py:37-59, 79-82), float32 in FL-bench, "
                      "float64 in "
                      "pfedkit; centroids count-weighted over the uploads on both (src/server/fedpac.py:37-66, "
                      "pfedkit "
                      "weighting=count)",
                  )),
    FlbenchMethod("FedAS", "fedas", "fedas",
                  {"fedas.alignment_epochs": 1, "fedas.alignment_lr": 0.01, "fedas.alignment_loss": "flbench",
                   "fedas.fisher_batch_size": "B", "fedas.aggregation": "fisher", "fedas.private_head": False},
                  {"fedas.alignment_epoch": 1, "fedas.alignment_lr": 0.01, "common.test.client.interval": 1},
                  curve="test_results",
                  departures=("FL-bench shares the whole model: the client loads the whole global model "
                              "(src/client/fedavg.py:143) before aligning its base (src/client/fedas.py:46-53, "
                              "79-81), and the "
                              "server averages every parameter with the Fisher weights (src/client/fedas.py:39-44; "
                              "src/server/fedavg.py:677-701): pfedkit's private_head=false; the authors' code and "
                              "PFLlib keep the "
                              "head on the client (pfedkit's default), so both sides run FL-bench's reading",
                              "alignment: FL-bench's loss is, per label of the batch, F.mse_loss of the batch's "
                              "class-mean "
                              "feature to the prototype (src/client/fedas.py:83-96): alignment_loss=flbench "
                              "(pfedkit's default "
                              "is the authors'/PFLlib's per-sample MSE); 1 epoch, lr 0.01 "
                              "(src/server/fedas.py:19-20, both "
                              "defaults), a fresh SGD without momentum on the base, over the training loader (B, "
                              "shuffled, last "
                              "batch kept), as pfedkit's alignment Fit with drop_last=false",
                              "prototypes: class means of the kept previous model's base features, eval mode, all "
                              "training rows "
                              "(src/client/fedas.py:58-77; kept model = the package after training, :43, stored by "
                              "the server "
                              ":31-34, sent back :36-44; in the client's first round the received global model, "
                              ":50-51) = "
                              "pfedkit's own model's body (the initial model in round 1, equal to the global one)",
                              "Fisher trace: after training, eval mode, over the training loader (batch B, shuffled, "
                              "last batch "
                              "kept), sum over batches of ||grad of the batch-mean NLL||^2 over every parameter "
                              "(src/client/fedas.py:17-37, 42) = pfedkit's fisher_trace with fisher_batch_size=B; "
                              "FL-bench's "
                              "shuffle is torch's global RNG, pfedkit's seeded: different batch partitions, so the "
                              "traces differ "
                              "by draws; FL-bench sums float32 .item() values, pfedkit float64",
                              "evaluated model: metrics.csv's accuracy_test_before is the received global model with "
                              "its base "
                              "already aligned (set_parameters aligns before train_with_eval evaluates, "
                              "src/client/fedas.py:52-53, "
                              "src/client/fedavg.py:101), which neither the authors nor pfedkit evaluate; FL-bench's "
                              "test path "
                              "(testing=True) loads the client's kept trained model (src/client/fedas.py:54-56), "
                              "pfedkit's "
                              "evaluated model (own, as its training returned it) and the authors'/PFLlib's: curve "
                              "test_results, "
                              "++common.test.client.interval=1 (overrides FLBENCH_FIXED's -1, later on the command "
                              "line)",
                              "test_results key k is written after epoch k-1's training and aggregation "
                              "(src/server/fedavg.py:"
                              "481-485, 555-556) and evaluates the models trained in the k-th round (the server "
                              "stores them "
                              "before aggregating, src/server/fedas.py:31-34): pfedkit's round k, round_shift 0",
                              "the test path trains nothing and draws no random numbers (no alignment while testing, "
                              "src/client/fedas.py:52-56; the test loader is not shuffled), so FL-bench's training "
                              "is the same as "
                              "with interval=-1; metrics.csv's accuracy_test_after of epoch k-1 evaluates the same "
                              "models on the "
                              "same rows (a cross-check of the closing JSON)",
                              "aggregation order: FL-bench in the round's random.sample order, pfedkit in ascending "
                              "id: float "
                              "rounding only")),
    FlbenchMethod("FedGen", "fedgen", "fedgen",
                  {"fedgen.alpha": 10.0, "fedgen.beta": 10.0, "fedgen.decay": 0.98, "fedgen.generator_steps": 5,
                   "fedgen.generator_batch_size": "B", "fedgen.generator_lr": 0.0003, "fedgen.generator_weight_decay": 0.0,
                   "fedgen.eta": 1.0, "fedgen.hidden_dim": 32, "fedgen.noise_dim": 32, "fedgen.noise": "gaussian",
                   "fedgen.client_labels": "own", "fedgen.teacher_loss": "weighted_ce"},
                  {"fedgen.generative_alpha": 10, "fedgen.generative_beta": 10, "fedgen.coef_decay": 0.98,
                   "fedgen.coef_decay_epoch": 1, "fedgen.train_generator_epoch": 5, "fedgen.ensemble_lr": 0.0003,
                   "fedgen.ensemble_alpha": 1, "fedgen.ensemble_beta": 0, "fedgen.ensemble_eta": 1,
                   "fedgen.hidden_dim": 32, "fedgen.noise_dim": 32, "fedgen.use_embedding": 0,
                   "fedgen.gen_batch_size": "B", "fedgen.min_samples_per_label": 1},
                  departures=("teacher: FL-bench loads each participant's model into teacher_model but computes every teacher "
                              "term with self.model.classifier (src/server/fedgen.py:98-111), the global head the "
                              "clients "
                              "received this epoch (train_generator runs before aggregate_client_updates, :72-75); "
                              "the label "
                              "weights of a qualified label sum to 1 over the participants (:133-145), so its "
                              "generator loss is "
                              "CE(h_global(G(y)), y) + eta L_div; pfedkit's teachers are the participants' trained "
                              "heads (the "
                              "paper's ensemble, the FedGen code's weighted_ce); no pfedkit option takes the "
                              "received global head",
                              "server steps: FL-bench takes train_generator_epoch = 5 Adam steps a round "
                              "(src/server/fedgen.py:39, "
                              "87; ensemble_epoch 50 at :38 is never read) on common.batch_size labels (:88), Adam "
                              "lr 3e-4 without "
                              "weight decay (:26, 47-49), lr x 0.98 a round (ExponentialLR, gamma hard-coded, "
                              ":51-53, 128): "
                              "pfedkit's generator_steps 5 (default 50), generator_batch_size B (32), "
                              "generator_weight_decay 0 "
                              "(1e-2), decay 0.98",
                              "diversity: FL-bench's ensemble_eta default 0 (src/server/fedgen.py:32) switches the "
                              "diversity loss "
                              "off; both set to pfedkit's eta = 1; FL-bench's DiversityLoss('l1') (:207-234) is "
                              "pfedkit's "
                              "diversity_loss. ensemble_beta 0 (:31, the generator's student KL; under the teacher "
                              "bug student and "
                              "teacher are the same head, so it would be 0 anyway), ensemble_alpha 1",
                              "generator: one-hot label + eps ~ N(0, I) (torch.randn, src/server/fedgen.py:192-204), "
                              "Linear(32 + 10, H) -> BatchNorm1d -> ReLU -> Linear(H, 512) (:175-187), H = 32 by "
                              "FL-bench's default "
                              "(:34): pfedkit's hidden_dim 32 (default 256), noise gaussian, noise_dim 32; PyTorch's "
                              "default "
                              "initialisation on both, different draws",
                              "client coefficients: FL-bench regularises from epoch 1 (:59) with max(1e-4, 10 * "
                              "0.98^e), e the "
                              "0-based epoch (:147-155); pfedkit from round 2 with max(1e-4, 10 * 0.98^(r-1)): the "
                              "same "
                              "coefficient for the same training round",
                              "generated CE: FL-bench draws gen_batch_size labels per batch from the client's own "
                              "labels and "
                              "weights the term gen_ratio = gen_batch_size / B (src/client/fedgen.py:66-82); pfedkit "
                              "takes one "
                              "(yhat, eps') per training row, B per batch, at weight alpha: "
                              "++fedgen.gen_batch_size=B makes "
                              "gen_ratio 1 and B labels a batch, as pfedkit (FL-bench's default 32 would weight the "
                              "term 0.32 alpha); "
                              "client_labels=own; FL-bench's last batch (80 rows) still draws B",
                              "draws: FL-bench draws fresh yhat, eps', eps for every batch of every epoch "
                              "(src/client/fedgen.py:57, "
                              "66-74, numpy's and torch's global RNGs); pfedkit one set per training row and round, "
                              "reused in each "
                              "of the E = 5 epochs: the same distribution per batch, 5x fewer distinct generated "
                              "samples",
                              "generator mode on clients: FL-bench train mode (src/client/fedgen.py:45), BatchNorm "
                              "with each call's "
                              "batch statistics; pfedkit eval mode with the running statistics of the server's steps "
                              "(momentum 0.1, "
                              "5 steps a round: after round 1 the running mean holds 1 - 0.9^5 = 41% of the batch "
                              "means), so the "
                              "generated features differ most in the early rounds; no pfedkit option for train mode",
                              "qualified labels: FL-bench mean count over participants > 1 "
                              "(src/server/fedgen.py:139-143), pfedkit "
                              "max count > 1: the same labels here (every client holds every class)",
                              "evaluated model: the global model on both; accuracy_test_before is the received "
                              "global model "
                              "(src/client/fedavg.py:101), pfedkit's after_download global (evaluated_model global), "
                              "the paper's")),
    FlbenchMethod("FedFomo", "fedfomo", "fedfomo",
                  {"fedfomo.num_peers": 4, "fedfomo.epsilon": 0.0, "fedfomo.val_ratio": 0.2},
                  {"fedfomo.M": 5, "fedfomo.valset_ratio": 0.2, "common.test.client.interval": 1},
                  curve="test_results",
                  departures=(
                      "peers: FL-bench takes the top M of the whole row P[i, previous round's clients], the client "
                      "itself "
                      "included (src/server/fedfomo.py:38-43). P[i, i] = 1 (:25) never grows because the own ratio "
                      "is 0, "
                      "while the other entries grow by ratios that are 96 times smaller (next departure). So the own "
                      "model "
                      "always takes one of the M = 5 slots and FL-bench mixes 4 peers. pfedkit picks only other "
                      "clients: "
                      "num_peers = 4 reproduces this (FL-bench keeps its default M = 5)",
                      "ratio scale: FL-bench's validation losses are Metrics.loss of the mean-reduced criterion "
                      "(src/client/fedfomo.py:51-56, 65-70; src/client/fedavg.py:72; "
                      "src/utils/functional.py:117-119; "
                      "src/utils/metrics.py:31-35), i.e. the batch mean divided again by the 96 validation rows (one "
                      "batch "
                      "of B = 100). Its ratios (:72), and so its P increments (src/server/fedfomo.py:29-31), are "
                      "pfedkit's "
                      "divided by 96. The normalised weights and the ranking among peers are unchanged",
                      "exploration: FL-bench has none, just plain top-M (src/server/fedfomo.py:38-43). So pfedkit's "
                      "epsilon = 0, where its default is 0.3 (the paper's epsilon-greedy)",
                      "ties: P rows hold many equal entries: 0 for every peer never chosen, and for all 19 peers in "
                      "round 2. "
                      "FL-bench breaks ties by torch.topk's order over the round's random.sample order "
                      "(src/server/fedfomo.py:35-43, src/server/fedavg.py:122-128), pfedkit by the lowest id. So "
                      "from "
                      "round 2 on, the peers a client downloads differ",
                      "validation split: FL-bench draws a new random 20 % of the training rows every time a client "
                      "is loaded "
                      "(src/client/fedfomo.py:24-30: every round and every test). A client therefore trains on all "
                      "480 rows "
                      "over the rounds, and about 80 % of the rows that give L(theta_old) were in its previous "
                      "round's "
                      "training. That biases the own loss low, gives fewer positive weights and moves the run closer "
                      "to "
                      "Local. pfedkit, like the paper, holds out one fixed random set of 96 rows and never trains on "
                      "them. "
                      "No pfedkit option draws a new split each round",
                      "downloads within a round: FL-bench trains the round's clients one after another and packages "
                      "a "
                      "client's downloads just before it trains (src/utils/trainer.py:42-45). Those come from stored "
                      "models "
                      "that the round's earlier clients have already replaced (:54-56; the whole model is personal, "
                      "src/client/fedfomo.py:15). So a client late in the random order mixes peers trained this "
                      "round, and "
                      "an early one mixes last round's. In pfedkit every download is a previous-round model, as in "
                      "the "
                      "authors' server (uploaded_clients)",
                      "evaluated model: FL-bench's accuracy_test_before is the mixed start theta_old + sum_j w_j "
                      "(theta_j - theta_old) before local training. The mixing is done in set_parameters "
                      "(src/client/fedfomo.py:33-94) and evaluated at src/client/fedavg.py:101. The authors' code "
                      "also "
                      "evaluates there (main.py: initialize_clients -> local_eval -> local_train). pfedkit evaluates "
                      "the "
                      "client's own trained model (evaluated_model own, as PFLlib). In FL-bench that model is "
                      "accuracy_test_after of epoch k - 1, and it is also the test path's 'before': in the test path "
                      "only "
                      "the own model is sent (src/server/fedfomo.py:37, 49) and its weight of 0 keeps it "
                      "(src/client/fedfomo.py:77-80). So the curve here is the test path (key k = the models trained "
                      "in k "
                      "rounds = pfedkit's round k). No pfedkit option evaluates the mixed start",
                      "the test path's set_parameters draws a new validation split for all 20 clients "
                      "(random.shuffle, "
                      "Python's RNG, src/client/fedfomo.py:28). FL-bench's later validation splits therefore differ "
                      "from a "
                      "run without the test path. It reads no torch RNG (test.client.train and val are false)",
                      "round 1: FL-bench downloads no peers at epoch 0 (src/server/fedfomo.py:37), and pfedkit "
                      "downloads 4 "
                      "copies of the initial model, all with ratio 0. Both keep theta_old and leave P unchanged, so "
                      "this is "
                      "not a difference",
                      "distances: FL-bench uses float32 vectorize over the state dict (src/client/fedfomo.py:49, "
                      "71), pfedkit "
                      "float64 (FedAvgCNN has no buffers): rounding only",
                  )),
)}

# FL-bench methods that do not compute the paper's method under this protocol, read in its code at
# FLBENCH_COMMIT: no row can check pfedkit against them; each is a departure of FL-bench (file:line).
FLBENCH_NOT_COMPARABLE = {
    "SCAFFOLD": "FL-bench never stores a client's control variate: the client rebinds self.c_local = c_i+ on its "
                "worker (src/client/scaffold.py:45) while the server keeps sending its own zero tensors "
                "(src/server/scaffold.py:29, 34), which nothing writes back (src/utils/trainer.py:51-62); every "
                "local step is corrected by c instead of c - c_i (src/client/scaffold.py:64-68). The server's c is "
                "still the paper's with every client every round (c_i cancels in c_i+ - c_i), but the clients' "
                "correction is not: from round 2 on FL-bench runs another method, and no option of either side "
                "keeps c_i at 0",
    "FedALA": "FL-bench keeps no per-client FedALA state: in serial mode one client object trains every client "
              "(src/utils/trainer.py:18-19), and the element-wise weights W and the start-phase flag are attributes "
              "of that object (src/client/fedala.py:16-17, 90-93, 142); the local model ALA mixes with the global "
              "one "
              "is the previous client's trained model (:56-58), and the run-to-convergence first ALA is spent in "
              "round 1, where the global and local models are equal and W cannot move (:55-67). The paper keeps "
              "theta_i and W_i per client, as pfedkit",
    "LG-FedAvg": "FL-bench's global layers are the FIRST num_global_layers layers and the rest stay personal "
                 "(src/client/lgfedavg.py:10-21, default 1): for FedAvgCNN only conv1 is averaged, and no value "
                 "makes the classifier global with the body private (3 is FedPer). The paper and its authors' code "
                 "average the top layers and keep the body local, as pfedkit",
    "FedRoD": "FL-bench's clients never receive the global model: the server sends base.* and classifier.* "
              "(src/server/fedavg.py:653-657) to a client model named generic_model.* and personalized_classifier.* "
              "(src/client/fedrod.py:26-28, 146-151), and load_state_dict(strict=False) (src/client/fedavg.py:143) "
              "loads none of them; the one serial worker trains a single chain through the clients and the server's "
              "average is never used. It also trains the body through the personal loss "
              "(src/client/fedrod.py:94-102) "
              "and predicts with the personal logits alone (:157-163), where the paper predicts with z_G + z_P",
    "pFedMe": "FL-bench never stores the personalised model: each client's personalised weights are the server's "
              "copy of the initial model (src/server/pfedme.py:30-39), which the client loads to evaluate "
              "(src/client/pfedme.py:64-70) and sends back unchanged (:32-36), and which the server never updates; "
              "every FL-bench output evaluates the untrained model (training itself follows the paper's equations)",
    "APFL": "FL-bench's APFL steps the global copy twice per batch: with no zero_grad between its two backward "
            "passes, the second optimizer step applies the global model's gradient again (src/client/apfl.py:54-65). "
            "It also mixes the two models' outputs, not their parameters, in training and evaluation "
            "(src/client/apfl.py:60-63, 97-113; the authors' FedTorch code does the same), where the paper and "
            "pfedkit mix parameters, and adds 0.02 alpha to alpha's gradient in the first epoch only (:67-68, 74-89)",
    "pFedLA": "FL-bench's pFedLA is Local: every parameter is personal, so a client receives its own stored "
              "model beside the hypernetwork's mixture (src/server/pfedla.py:112) and loads it after the mixture "
              "(src/client/fedavg.py:143-144), which it overwrites; each client trains and is evaluated on its own "
              "previous model and the hypernetwork never reaches a number (the paper trains and evaluates the "
              "mixture)",
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
