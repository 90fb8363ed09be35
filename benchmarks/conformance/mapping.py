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
    pfllib_model: tuple[int, int, int] = (1, 10, 1024)  # FedAvgCNN(in_features, num_classes, dim) main.py builds


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
    # PFLlib's 'Round number: r' block is pfedkit's round r + pfllib_round_shift (1 where PFLlib
    # evaluates after the round's training, before the aggregation: its round 0 is one training in)
    pfllib_round_shift: int = 0


SPLITS = {
    "mnist_fedrema": Split("mnist_fedrema", HERE / "mnist_fedrema.yaml", "MNIST", rounds=25),
    "cifar10_dir01": Split("cifar10_dir01", HERE / "cifar10_dir01.yaml", "Cifar10", rounds=25,
                           pfllib_model=(3, 10, 1600)),
    # `pfedkit bench`'s partition under PFLlib's loop, for PFLlib's time per round (the GPU anchor): no curves
    "mnist_dir01_bench": Split("mnist_dir01_bench", HERE / "mnist_dir01_bench.yaml", "MNIST", rounds=3),
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
                       "(clientapfl.py:76-78): not in pfedkit, not yet measured",
                       "PFLlib overwrites the personal model v_i with the mixture (1 - alpha) w_i + alpha v_i after "
                       "training (clientapfl.py:58-59), so the next round's v starts from that mixture; pfedkit "
                       "keeps the trained v_i and mixes only to evaluate (the paper's reading)")),
    Method("FedAMP", "fedamp", "FedAMP", {"fedamp.alpha_k": 1.0, "fedamp.lam": 1.0, "fedamp.sigma": 1.0},
           {"-alk": 1.0, "-lam": 1.0, "-sg": 1.0},
           departures=("PFLlib's defaults (alpha_K = lam = sigma = 1) on both; pfedkit's are cwFedAvg's",)),
    Method("FedFomo", "fedfomo", "FedFomo", {"fedfomo.num_peers": 5, "fedfomo.epsilon": 0.0,
                                            "fedfomo.val_ratio": 0.2}, {"-M": 5},
           departures=("PFLlib's validation rows are the last 20 % of the training rows, fixed (clientfomo.py:66); "
                       "pfedkit draws them at random once per client",)),
    Method("FedGH", "fedgh", "FedGH", {"fedgh.server_lr": 1.0, "fedgh.server_batch_size": "B"}, {"-slr": 1.0},
           departures=("PFLlib trains the server head on the prototypes with the clients' batch size "
                       "(servergh.py:93): pfedkit's server_batch_size = B",
                       "PFLlib's server head is client 0's head module (servergh.py:27; clientgh.py:47-49 copies "
                       "it onto itself): client 0's local training moves it, so each round's server training "
                       "starts from client 0's trained head; pfedkit's server head is its own, trained from the "
                       "previous global head (the paper's reading)")),
    Method("FedRoD", "fedrod", "FedROD", {"fedrod.gamma": 1.0}),
    Method("FedPAC", "fedpac", "FedPAC", {"fedpac.lam": 1.0}, {"-lam": 1.0},
           departures=("PFLlib's FedPAC needs the real cvxpy (its head weights); not stubbed for this method",)),
)}

# Methods I and II (issues 45 and 46). Where pfedkit's default differs from PFLlib's, both sides take
# PFLlib's default (its flag passed explicitly), unless PFLlib's default switches a term of the method
# off; then both take pfedkit's default. File:line in PFLlib system/ at d832e76.
METHODS_I_II = (
    Method("FedNTD", "fedntd", "FedNTD", {"fedntd.beta": 1.0, "fedntd.tau": 1.0}, {"-bt": 1.0, "-tau": 1.0},
           departures=("PFLlib's beta is -bt, default 0 (clientntd.py:14, main.py:446): FedAvg; both set to "
                       "pfedkit's beta = 1 (the official config)",
                       "PFLlib's server mean is uniform, 1/num_join_clients, whatever the weights "
                       "(serverntd.py:69-71); pfedkit's is FedAvg's n_i: the same on mnist_fedrema (480 training "
                       "rows a client), not on cifar10_dir01",
                       "PFLlib runs the frozen global model on each batch (clientntd.py:41); pfedkit computes its "
                       "logits once a round: the same numbers on a model without BatchNorm or dropout")),
    Method("FedLC", "fedlc", "FedLC", {"fedlc.tau": 1.0, "fedlc.counts": "global", "fedlc.denominator": "all"},
           {"-tau": 1.0},
           departures=("PFLlib's margins use the federation's class counts, one vector for every client "
                       "(serverlc.py:20-26): counts=global; the paper's are the client's own (pfedkit's default)",
                       "PFLlib's softmax runs over every class, CrossEntropyLoss(z - margins) (clientlc.py:40): "
                       "denominator=all; the paper's printed equation leaves the true class out",
                       "PFLlib counts the classes over one pass of its drop_last, shuffled loader "
                       "(clientlc.py:13-16): 400 random rows of a client's 480 at B = 100; pfedkit counts all rows")),
    Method("FedBN", "fedbn", "FedBN", {"model": "cnn"},
           departures=("PFLlib's -m CNN on MNIST and CIFAR-10 is FedAvgCNN (main.py:91-95, models.py:146), "
                       "which has no BatchNorm: PFLlib's FedBN is FedAvg here. Its only CNN with BatchNorm is "
                       "Digit5CNN (models.py:55), chosen for datasets named Digit5 (main.py:99-100), 3x32x32 input. "
                       "So pfedkit runs model=cnn too (FedAvg exactly, with a ConfigWarning); pfedkit's cnn_bn "
                       "has no PFLlib counterpart, and this row checks only that both reduce to FedAvg",
                       "PFLlib keeps local the parameters whose name contains 'bn' (clientbn.py:46-49), pfedkit "
                       "every BatchNorm layer by type; PFLlib's server averages them anyway (serverbase.py:138-150) "
                       "and the clients never load them; running statistics are buffers, never sent on either "
                       "side")),
    Method("SCAFFOLD", "scaffold", "SCAFFOLD", {"scaffold.option": "II", "scaffold.global_lr": 1.0,
                                                "scaffold.weights": "uniform"}, {"-slr": 1.0},
           departures=("PFLlib's server mean of y_i - x is uniform, / num_join_clients (serverscaffold.py:126-131; "
                       "the n_i weights of receive_models are unused): weights=uniform, the paper's",
                       "PFLlib's c_i is option II with K = len(trainloader) * E (clientscaffold.py:51-52, 69-73), "
                       "the drop_last batches: the K lr that pfedkit's step probe measures",)),
    Method("FedDyn", "feddyn", "FedDyn", {"feddyn.alpha": 1.0}, {"-al": 1.0},
           departures=("PFLlib's alpha is -al, default 1 (main.py:465); pfedkit's default 0.01: both set to 1",
                       "PFLlib's proximal term is alpha/2 * torch.norm(theta - theta^{t-1}, 2), the norm, not its "
                       "square (clientdyn.py:45): a pull of constant size alpha/2; the paper's (alpha/2)||.||^2 is "
                       "pfedkit's. Its gradient-state and server updates are the paper's (clientdyn.py:52-54, "
                       "serverdyn.py:82-107), so they assume the squared term")),
    Method("FedALA", "fedala", "FedALA", {"fedala.layers": 1, "fedala.sample_fraction": 0.8, "fedala.eta": 1.0,
                                          "fedala.threshold": 0.1, "fedala.num_pre_loss": 10},
           {"-p": 2, "-s": 80, "-et": 1.0},
           departures=("PFLlib's -p 2 counts parameter tensors: the last Linear's weight and bias, pfedkit's "
                       "layers=1; threshold 0.1 and num_pre_loss 10 are ALA's defaults (ALA.py:19-20), not flags",
                       "PFLlib's D_i^s is a contiguous slice of the client's training rows at a random start, in "
                       "file order (ALA.py:71-74); pfedkit draws a random subset each round; both keep the last, "
                       "incomplete batch (drop_last=False; pfedkit's ALA requests set Fit.drop_last=False "
                       "whatever the config's drop_last)",
                       "PFLlib's first ALA has no epoch bound (ALA.py:119-153); pfedkit stops at max_warmup_epochs=100",
                       "PFLlib runs ALA, W's training included (the whole warm-up on its first call), in "
                       "send_models before it evaluates (serverala.py:26-31, 70-74): its curve is the model after "
                       "this round's W epoch; pfedkit evaluates the ALA start with the current W, untrained")),
    Method("FedCP", "fedcp", "FedCP", {"fedcp.lam": 1.0, "fedcp.head_upload_share": 0.5}, {"-lam": 1.0},
           departures=("PFLlib's lambda is -lam, default 1 (main.py:447); pfedkit's default 5: both set to 1",
                       "PFLlib samples the policy by gumbel_softmax at evaluation too (servercp.py:171-176, no "
                       "train/eval switch): its test accuracy is of one random policy sample; pfedkit predicts "
                       "with the noise-free softmax [ours]",
                       "PFLlib's conditional input is torch.rand until the first global head arrives "
                       "(clientcp.py:18; set_head_g after the first aggregation, servercp.py:92, 134-135): its "
                       "first round trains with a random c_i; pfedkit's c_i is phi_i's column sums from round 1")),
    Method("GPFL", "gpfl", "GPFL", {"gpfl.lam": 1.0, "gpfl.mu": 0.1, "gpfl.conditional_inputs": "trained"},
           {"-lam": 1.0, "-mu": 0.1},
           departures=("PFLlib's lambda is -lam, default 1 (main.py:447; pfedkit's 0.01): both 1. Its mu is -mu, "
                       "default 0 (main.py:449), which drops the L2 of CoV and GCE: both set to pfedkit's 0.1",
                       "PFLlib computes g and p_i from the GCE the client trained, before loading the received one "
                       "(clientgpfl.py:101-113), zeros before (clientgpfl.py:31-32): conditional_inputs=trained",
                       "PFLlib's alpha_ic come from one pass of its drop_last, shuffled loader "
                       "(clientgpfl.py:34-40): 400 random rows of 480 at B = 100; pfedkit's n_ic / n_i use all rows")),
    Method("FedDBE", "feddbe", "FedDBE", {"feddbe.kappa": 50.0, "feddbe.momentum": 0.1},
           {"-klw": 50.0, "-mo": 0.1},
           departures=("PFLlib's kappa is -klw, default 0 (main.py:494), which drops the mean regularisation: both "
                       "set to pfedkit's 50. Its momentum is -mo, default 0.1 (main.py:493; pfedkit's 1, the "
                       "authors' script): both 0.1",
                       "PFLlib's initialisation period runs in the server's constructor: every client trains E "
                       "epochs from the initial model, the running means give z^g, and the trained models are "
                       "thrown away (serverdbe.py:15-35; send_models overwrites them): all its rounds are DBE rounds. "
                       "pfedkit's round 1 is that period as a FedAvg round whose aggregate is kept: pfedkit's "
                       "round r has 1 FedAvg and r - 1 DBE aggregations, PFLlib's r DBE aggregations")),
    Method("FedCAC", "fedcac", "FedCAC", {"fedcac.tau": 0.5, "fedcac.beta": 100.0}, {"-tau": 0.5, "-bt": 100},
           departures=("PFLlib's beta is -bt, default 0: int(0) fails its assert beta >= 1 at the end of round 1 "
                       "(servercac.py:12, 77); both set to pfedkit's 100 (int() truncates a fraction). Its tau is "
                       "-tau, default 1 (main.py:469): every parameter critical; both set to pfedkit's 0.5",
                       "PFLlib computes no customised model after its first training round (send_models skips "
                       "it while epoch == 0, servercac.py:120-122), yet the clients then hold masks: set_parameters "
                       "puts the initial model's values (customized_model, a copy taken at construction, "
                       "clientcac.py:13) on the critical parameters (clientcac.py:103-115). PFLlib's round-1 models "
                       "have their critical parameters reset to the initialisation; pfedkit's (the paper's) take "
                       "the collaborators' mean from round 1",
                       "PFLlib's threshold factor (epoch + 1) / beta (servercac.py:96) is pfedkit's t / beta, "
                       "t counted from 1")),
    Method("FedAS", "fedas", "FedAS", {"fedas.alignment_epochs": 1, "fedas.alignment_lr": 0.01,
                                       "fedas.alignment_loss": "pfllib", "fedas.fisher_batch_size": "B",
                                       "fedas.aggregation": "fisher", "fedas.private_head": True},
           departures=("PFLlib computes the prototypes and aligns in mini-batches of 16 (clientas.py:139-140, "
                       "170-185; lr 0.01 hard-coded): 30 alignment steps an epoch on 480 rows; pfedkit aligns "
                       "with the run's batch size (B = 100: 4 steps), no option changes it",
                       "PFLlib's Fisher trace runs over its training loader (clientas.py:62): batch B, drop_last, "
                       "so 80 random rows of 480 are left out; pfedkit's fisher_batch_size=B over every row",
                       "PFLlib averages whole models by Fisher weight (serveras.py:40-55) but loads only the body "
                       "(clientas.py:187-189): private heads, as pfedkit; it evaluates before sending "
                       "(serveras.py:69-75), the clients' own models as trained: pfedkit's evaluated model")),
    Method("FedPHP", "fedphp", "FedPHP", {"fedphp.lam": 0.1, "fedphp.transfer": "mmd", "fedphp.kernel": "pfllib",
                                          "fedphp.momentum": 0.9, "fedphp.schedule": "rounds",
                                          "fedphp.evaluate_with": "local"}, {"-lam": 0.1, "-mu": 0.9},
           departures=("PFLlib's lambda is -lam, default 1 (main.py:447): (1 - 1) CE + MMD, no label signal "
                       "(clientphp.py:42-43); its momentum is -mu, default 0 (clientphp.py:12): the HPM is the "
                       "last local model. Both set to pfedkit's lam = 0.1, momentum = 0.9",
                       "PFLlib's mu = (-mu / T) R, R the 0-based round (clientphp.py:12, 48): schedule=rounds; its "
                       "MMD's bandwidths 10, 15, 20, 50 (clientphp.py:93-130): kernel=pfllib",
                       "PFLlib evaluates after the clients' training and before the aggregation (serverphp.py:26-34), "
                       "the local models: evaluate_with=local. Its 'Round number: r' is after r + 1 trainings "
                       "(round 0 is not the initial model), so PFLlib's round r is pfedkit's round r + 1 "
                       "(pfllib_round_shift=1: the curves file holds PFLlib's rounds so shifted); the paper and "
                       "the authors evaluate the HPM"), pfllib_round_shift=1),
    Method("APPLE", "apple", "APPLE", {"apple.dr_lr": 0.001, "apple.mu": 0.1, "apple.scheduler": "cosine",
                                       "apple.decay_fraction": 1.0, "apple.constraint": "none",
                                       "apple.core_lr": "lr_times_clients", "apple.p_init": "uniform",
                                       "apple.dr_gradient": "layer_mean"}, {"-dlr": 0.001, "-mu": 0.2, "-L": 1.0},
           departures=("PFLlib's DR step size is -dlr, default 0 (main.py:473): p never moves; its mu is -mu, "
                       "default 0: no pull. Both set to pfedkit's dr_lr = 0.001 and mu = 0.1, PFLlib's -mu = 0.2: "
                       "its gradient lambda mu (p - p0) (clientapple.py:65) is pfedkit's 2 lambda mu (p - p0) at "
                       "half the mu",
                       "PFLlib's core step is N lr (clientapple.py:18): core_lr=lr_times_clients; p starts at 1/N "
                       "(clientapple.py:22), the centre p0 at the sample shares (serverapple.py:26-32): "
                       "p_init=uniform; dCE/dp_j is the mean over tensors of mean(g * w_j) (clientapple.py:58-64): "
                       "dr_gradient=layer_mean; -L 1 with the cosine (clientapple.py:17, 68-71)",
                       "PFLlib updates lambda after the round's training (clientapple.py:68-71): round r trains "
                       "with lambda(r - 1) (1 in its first round), one round behind pfedkit's lambda(r)",
                       "PFLlib's next core of client i is a copy of self.model, the mixture sum_j p_ij w_j taken "
                       "before the last batch's step (clientapple.py:48, 77), not the trained core: the 'recover' "
                       "copies model_cs[i] onto itself, the same object (clientapple.py:74-75, serverapple.py:84); "
                       "and since the cores list is shared and updated in place (clientapple.py:55-56), a client "
                       "later in the round mixes earlier clients' cores of this round. pfedkit uploads the trained "
                       "core (the paper's); no option reproduces this",
                       "PFLlib's p gradient for j = i reads the core after this batch's step (clientapple.py:55-62); "
                       "pfedkit takes both from the same point; PFLlib evaluates self.model, the mixture before the "
                       "last step (serverapple.py:39-44)")),
    Method("FedKD", "fedkd", "FedKD", {"fedkd.mentee_lr": 0.005, "fedkd.t_start": 0.95, "fedkd.t_end": 0.98,
                                       "fedkd.weighting": "uniform", "fedkd.kl_reduction": "pfllib"},
           {"-mlr": 0.005, "-Ts": 0.95, "-Te": 0.98},
           departures=("PFLlib's mentee lr is -mlr, default 0.005 (main.py:489): both set to it; its energy "
                       "threshold in its round i (0-based) is T_start + (i/R)(T_end - T_start), set at the end of "
                       "the previous round (serverkd.py:60), so its round r (1-based) uses (r - 1)/R where "
                       "pfedkit's uses r/R (docs/algorithms/fedkd.md): T one round behind, 0.0012 apart here",
                       "PFLlib compresses the mentee's parameters themselves, not their update, and its truncation "
                       "loop (clientkd.py:163-166, serverkd.py:147-150) never tests the full rank: a matrix that "
                       "needs all its singular values to reach T is rebuilt from none, i.e. as zeros. The initial "
                       "10 x 512 head has 91.7 % of its energy in its top 9 of 10 singular values (< T = 0.95; "
                       "checked with PyTorch's default Linear init), so PFLlib's mentee head weight is zeroed at "
                       "least in round 1, its mentee then predicts from its bias and the adaptive weight "
                       "1/(CE + CE_g) shrinks the distillation: PFLlib's mentor is expected to be near Local. "
                       "pfedkit compresses the update and keeps the fewest singular values reaching T "
                       "(never none)",
                       "PFLlib's server mean is 1/m (serverkd.py:124-126): weighting=uniform; its KL is "
                       "KLDivLoss(), the mean over B x C entries (clientkd.py:31): kl_reduction=pfllib",
                       "PFLlib divides each distillation and hidden loss by CE + CE_g inside autograd, so the "
                       "adaptive weight is differentiated and each loss trains both models; pfedkit's weight is "
                       "a constant of the step (the paper's reading); no option removes this",
                       "PFLlib's mentee hidden loss is the mentor's, MSE(rep, W_h(rep_g)) (clientkd.py:68-69), and "
                       "it clips the mentor, mentee and W_h at norm 10 (clientkd.py:80-82); pfedkit's FedKD step "
                       "does not clip",
                       "PFLlib's W_h is nn.Linear(d, d, bias=False) with PyTorch's default initialisation "
                       "(clientkd.py:24); pfedkit's starts as the identity (docs/algorithms/fedkd.md, [ours]): "
                       "the hidden loss starts at 0 in pfedkit, not in PFLlib")),
    Method("FML", "fml", "FML", {"fml.alpha": 0.5, "fml.beta": 0.5, "fml.kl_reduction": "pfllib",
                                 "fml.cross_gradients": True, "fml.weighting": "uniform"}, {"-al": 0.5, "-bt": 0.5},
           departures=("PFLlib's alpha is -al, default 1, its beta -bt, default 0 (main.py:465, 446): the local "
                       "model learns by CE alone, the meme by KL alone; both set to pfedkit's 0.5 and 0.5",
                       "PFLlib's KL is KLDivLoss() (clientfml.py:24), the mean over B x C entries: "
                       "kl_reduction=pfllib; neither peer's logits are detached (clientfml.py:49-55): "
                       "cross_gradients=True; the server's mean is 1/m (serverfml.py:96-98): weighting=uniform "
                       "(the same as n_i on mnist_fedrema)",
                       "PFLlib clips both models' gradients at norm 10 (clientfml.py:57-58); pfedkit's FML step is "
                       "a custom step, which the config's grad_clip does not reach: not measured")),
    Method("FedPCL", "fedpcl", "FedPCL", {"fedpcl.tau": 1.0, "fedpcl.global_weighting": "uniform",
                                          "fedpcl.prediction": "local", "fedpcl.unseen_clients": "global",
                                          "grad_clip": 10.0}, {"-tau": 1.0},
           departures=("PFLlib's tau is -tau, default 1 (main.py:469); pfedkit's 0.07 (FedPCL's code): both 1. "
                       "PFLlib clips the body's gradients at norm 10 (clientpcl.py:77): pfedkit's grad_clip=10",
                       "PFLlib stacks each prototype table in its dict's insertion order (clientpcl.py:33-45), the "
                       "order in which the classes first appear in a shuffled loader (clientpcl.py:99-116) and, "
                       "for the global table, across the clients (serverpcl.py:120-135); CrossEntropyLoss then "
                       "reads column y as class y (clientpcl.py:59-65). Unless that order is 0..C-1, the contrastive "
                       "targets are other classes' prototypes. pfedkit's tables are indexed by class (the paper's)",
                       "PFLlib's local prototypes are the class means over one pass of its shuffled drop_last "
                       "training loader (clientpcl.py:95-116, clientbase.py:59): 400 of 480 rows a round on "
                       "mnist_fedrema, and a rare class can be missed (then padded with the global prototype); "
                       "pfedkit's are the means over every training row",
                       "PFLlib's padding writes global prototypes into the client's own table, the same dict "
                       "(serverpcl.py:84, 109-116), so its evaluation also scores the classes the client lacks; it "
                       "predicts by the largest dot product <r, C> (clientpcl.py:138-142), with prototypes that are "
                       "not unit vectors; pfedkit (prediction=local) takes the nearest own prototype in L2",
                       "PFLlib's round 0 prints 0 (no prototypes yet, clientpcl.py:148-149); rows leave round 0 out")),
    Method("FedGen", "fedgen", "FedGen", {"fedgen.alpha": 1.0, "fedgen.beta": 0.0, "fedgen.decay": 1.0,
                                          "fedgen.generator_steps": 1000, "fedgen.generator_batch_size": "B",
                                          "fedgen.generator_lr": 0.005, "fedgen.generator_weight_decay": 0.0,
                                          "fedgen.eta": 0.0, "fedgen.hidden_dim": 512, "fedgen.noise_dim": 512,
                                          "fedgen.noise": "uniform", "fedgen.client_labels": "all",
                                          "fedgen.teacher_loss": "ensemble_ce"},
           {"-se": 1000, "-glr": 0.005, "-hd": 512, "-nd": 512},
           departures=("PFLlib's FedGen is the code's core only: the client adds CE(h(G(y')), y') with weight 1, no "
                       "KL term, no decay (clientgen.py:54-60): alpha=1, beta=0, decay=1; the server takes -se 1000 "
                       "Adam steps at -glr 0.005, no weight decay, no diversity term, on B labels a step "
                       "(servergen.py:35-38, 143-162): eta=0, generator_batch_size=B; eps ~ U(0, 1) "
                       "(servergen.py:208): noise=uniform; -nd 512, -hd 512",
                       "PFLlib regularises from its first round, with the untrained generator (clientgen.py:57-60); "
                       "pfedkit's round 1 is plain CE (the FedGen code's)",
                       "PFLlib draws the labels, on the clients and the server, from every training label of every "
                       "client (servergen.py:43-48, clientgen.py:57, servergen.py:147): the federation's label "
                       "frequencies; pfedkit's are uniform (client_labels=all; the server: over the labels the "
                       "participants hold)",
                       "PFLlib's teacher is the n_i-weighted ensemble of the participants' heads (servergen.py:"
                       "151-160); pfedkit's ensemble_ce weights each label by the participants' counts of it",
                       "PFLlib's generator stays in train mode when the clients use it (servergen.py:144: its "
                       "BatchNorm uses batch statistics); pfedkit's is in eval mode; PFLlib draws B fresh labels "
                       "a batch (clientgen.py:57), pfedkit one per training sample a round")),
)
METHODS.update((m.label, m) for m in METHODS_I_II)

# Methods I and II that PFLlib implements but whose pfedkit side is not written yet: the PFLlib facts
# read so far, for the entry to come.
NOT_MAPPED_YET: dict[str, str] = {}  # PFLlib methods whose pfedkit algorithm is not written yet: their facts


def pfedkit_overrides(method: Method, split: Split, seed: int, rounds: int) -> list[str]:
    """`key=value` overrides of the split's config for one method, seed and round count."""
    config = read_split_config(split)
    values = {"algorithm": method.pfedkit, "seed": seed, "rounds": rounds}
    for key, value in method.pfedkit_options.items():
        values[key] = resolve_placeholder(value, config)
    return [f"{key}={value}" for key, value in values.items()]


def resolve_placeholder(value, config: dict):
    """'LR' -> the split's lr, '2E' -> twice its local epochs, 'B' -> its batch size, 'PAIRED_BATCHES'
    -> `paired_batches`; anything else as is."""
    if value == "LR":
        return config["lr"]
    if value == "B":
        return config["batch_size"]
    if value == "2E":
        return 2 * config["local_epochs"]
    if value == "PAIRED_BATCHES":
        return paired_batches(config)
    return value


def paired_batches(config: dict) -> int:
    """2 E floor(b / 2): the batches of E epochs that each use floor(b / 2) pairs of their b = ceil(n / B)
    batches (the last one kept), n the training rows of every client; only for a split whose clients
    all hold samples_per_client * train_ratio training rows."""
    partition = config.get("partition", {})
    if "samples_per_client" not in partition or "train_ratio" not in partition:
        raise SystemExit("this row needs a split whose clients are all the same size (partition "
                         "samples_per_client and train_ratio)")
    rows = round(partition["samples_per_client"] * partition["train_ratio"])
    batches = -(-rows // config["batch_size"])
    return 2 * config["local_epochs"] * (batches // 2)


def read_split_config(split: Split) -> dict:
    import yaml

    return yaml.safe_load(split.config.read_text())


def pfllib_arguments(method: Method, split: Split, dataset_name: str, rounds: int, tag: str,
                     device: str = "cpu") -> list[str]:
    """main.py's arguments for one method on the exported split. `device`: "cpu", "cuda" or "cuda:N"
    (PFLlib's -dev cuda with -did N, which main.py turns into CUDA_VISIBLE_DEVICES=N)."""
    config = read_split_config(split)
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise ValueError(f"device {device!r}: PFLlib runs on cpu, cuda or cuda:N")
    arguments = {"-data": dataset_name, "-m": "CNN", "-algo": method.pfllib, "-gr": rounds, "-dev": kind,
                 "-nc": config["num_clients"], "-ncl": 10, "-jr": config["join_ratio"],
                 "-ls": config["local_epochs"], "-lbs": config["batch_size"], "-lr": config["lr"],
                 "-eg": 1, "-t": 1, "-go": tag}
    if kind == "cuda":
        arguments["-did"] = index or "0"
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
