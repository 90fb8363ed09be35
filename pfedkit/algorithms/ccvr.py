"""CCVR (Luo, Chen, Hu, Zhang, Liang, Feng, NeurIPS 2021): Classifier Calibration with Virtual
Representations. FedAvg training; the server re-trains the classifier on features sampled from a
Gaussian per class whose moments the clients' features give.

Features z = f_theta(x) are the body's output (the head must be one Linear layer). For a model
w^t = (theta^t, phi^t), client k computes for each class c it holds (N_{c,k} samples):

    mu_{c,k}    = (1 / N_{c,k}) sum_j z_{c,k,j}                                              (1)
    Sigma_{c,k} = 1 / (N_{c,k} - 1) sum_j (z_{c,k,j} - mu_{c,k})(z_{c,k,j} - mu_{c,k})^T     (2)

and uploads them with N_{c,k}. The server forms the moments of the union of the clients' features,
N_c = sum_k N_{c,k}:

    mu_c    = sum_k (N_{c,k} / N_c) mu_{c,k}                                                  (3)
    Sigma_c = sum_k (N_{c,k} - 1)/(N_c - 1) Sigma_{c,k} + sum_k N_{c,k}/(N_c - 1) mu_{c,k} mu_{c,k}^T
              - N_c/(N_c - 1) mu_c mu_c^T                                                     (4)

draws M virtual features per class from N(mu_c, Sigma_c) (5) and trains phi^t on them with SGD (6),
giving the calibrated classifier phi_hat^t; the calibrated model is (theta^t, phi_hat^t).

pfedkit evaluates every round, so [ours] the calibration runs inside the rounds: in round t the
participants compute (1)-(2) on the model they download, w^t (eval mode, their own BatchNorm
statistics), then train it as FedAvg does; the server averages the trained models into w^{t+1}
(FedAvg, which keeps training) and calibrates w^t with (3)-(6). The evaluated model after round t
is the calibrated w^t, the model the round started from (its statistics need a pass over the
clients' data, which the next pass comes with). `calibration`: every_round (default), last_round
(the paper's single post-hoc calibration: FedAvg until the last round, which calibrates) or off
(FedAvg exactly, messages included). Classes no participant holds this round keep their rows of
phi^t (the softmax of the re-training is over the calibrated classes). Server state: w^{t+1} and
the calibrated model. Client state: none. Communication: FedAvg's, + per calibrating participant
C_k (d + d^2) floats (means, covariances) and 2 C_k integers (classes, counts), C_k its classes.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from pydantic import Field

from pfedkit.algorithms.extra_layers import check_linear_head
from pfedkit.algorithms.creff import mean_cross_entropy, retrain_classifier
from pfedkit.algorithms.registry import register
from pfedkit.core.aggregation import Aggregation, SampleWeightedMean
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, HyperParams, Message
from pfedkit.core.errors import ConfigError
from pfedkit.core.params import Params, clone, linear_layer_names, merge, select
from pfedkit.core.search import float_range, int_range
from pfedkit.core.seeds import SERVER, torch_generator

FEATURE_CHUNK = 512  # samples per eval-mode forward when computing features (memory bound only)
Statistics = dict[str, torch.Tensor]  # a client's upload: classes, counts, means, covariances


# ---------------------------------------------------------------------------------------------
# The math (pure functions)


def class_statistics(features: torch.Tensor, labels: torch.Tensor) -> Statistics:
    """Eqs. (1)-(2) for each class present in `labels` (ascending): {"classes", "counts" (int64),
    "means" [k, d], "covariances" [k, d, d]} in the features' dtype, computed in float64. A class
    with one sample has no covariance (N - 1 = 0): zeros, which eq. (4) weights by N - 1 = 0."""
    classes, counts = torch.unique(labels, return_counts=True)
    means, covariances = [], []
    for c, count in zip(classes.tolist(), counts.tolist()):
        z = features[labels == c].double()
        centred = z - z.mean(0)
        means.append(z.mean(0))
        covariances.append(centred.T @ centred / max(count - 1, 1))
    dtype = features.dtype
    return {"classes": classes.long(), "counts": counts.long(),
            "means": torch.stack(means).to(dtype), "covariances": torch.stack(covariances).to(dtype)}


def pooled_statistics(uploads: list[Statistics], num_classes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eqs. (3)-(4): (N_c [C] int64, mu_c [C, d], Sigma_c [C, d, d]) over the uploads, in float64,
    summed in the given order. Classes nobody holds: N_c = 0 and zeros; N_c = 1: Sigma_c = 0."""
    dim = uploads[0]["means"].shape[-1]
    totals = torch.zeros(num_classes, dtype=torch.long)
    sums = torch.zeros(num_classes, dim, dtype=torch.float64)          # sum_k N_{c,k} mu_{c,k}
    scatter = torch.zeros(num_classes, dim, dim, dtype=torch.float64)  # the numerator of eq. (4)
    for upload in uploads:
        counts, means = upload["counts"], upload["means"].double()
        index, weight = upload["classes"], counts.double()[:, None]
        totals[index] += counts
        sums[index] += weight * means
        scatter[index] += ((weight - 1)[:, :, None] * upload["covariances"].double()
                           + weight[:, :, None] * means[:, :, None] * means[:, None, :])
    held = totals.double().clamp_min(1)
    means = sums / held[:, None]
    scatter -= totals.double()[:, None, None] * means[:, :, None] * means[:, None, :]
    covariances = scatter / (totals.double() - 1).clamp_min(1)[:, None, None]
    covariances[totals <= 1] = 0
    return totals, means, covariances


def sample_virtual_features(means: torch.Tensor, covariances: torch.Tensor, per_class: int,
                            generator: torch.Generator) -> torch.Tensor:
    """Eq. (5): [k, M, d] draws from N(mu_c, Sigma_c) for each of the k classes: z = mu + (eps *
    sqrt(lambda)) V^T with Sigma = V diag(lambda) V^T (float64 eigendecomposition, eigenvalues
    clamped at 0 so that a singular or slightly indefinite Sigma still gives a Gaussian on its
    support), eps ~ N(0, I) from `generator`."""
    eigenvalues, eigenvectors = torch.linalg.eigh(covariances.double())
    scales = eigenvalues.clamp_min(0).sqrt()
    noise = torch.randn(*means.shape[:-1], per_class, means.shape[-1], generator=generator, dtype=torch.float64)
    return (means.double()[:, None, :] + (noise * scales[:, None, :]) @ eigenvectors.transpose(-1, -2)).float()


# ---------------------------------------------------------------------------------------------
# The algorithm


class CalibratingRound:
    """A calibrating round's aggregation: FedAvg's streamed mean of the models, and each reply's
    statistics kept (C_k (d + d^2) floats, not a model) until `finish` pools them in client order."""

    def __init__(self, mean: SampleWeightedMean, result: Callable[[Params, dict[int, Statistics]], Any],
                 empty: Any) -> None:
        self.mean, self.result, self.empty = mean, result, empty
        self.statistics: dict[int, Statistics] = {}

    def add(self, cid: int, reply: Message) -> None:
        self.mean.add(cid, reply)
        self.statistics[cid] = reply["statistics"]

    def finish(self) -> Any:
        mean = self.mean.finish()
        return self.empty if mean is None else self.result(mean, dict(sorted(self.statistics.items())))


@register
class CCVR(Algorithm):
    name = "ccvr"
    description = "CCVR: FedAvg + the classifier re-trained on virtual features from pooled per-class Gaussians"
    evaluated_model = "custom"  # the downloaded model's body with the server's calibrated classifier
    quick_test_options = {"virtual_per_class": 20, "calibration_epochs": 2}

    class Hyper(HyperParams):
        """CCVR options. The paper's re-training settings could not be read here: ours are marked."""
        calibration: Literal["every_round", "last_round", "off"] = Field(
            "every_round", description="when the classifier is calibrated: every round (on the model the round "
            "started from), in the last round only (the paper's post-hoc calibration), or never (FedAvg)")
        virtual_per_class: int = Field(100, ge=1, description="M: virtual features drawn per class")
        calibration_epochs: int = Field(10, ge=0, description="SGD epochs over the virtual features",
                                        json_schema_extra=int_range(1, 50, log=True))
        calibration_lr: float = Field(0.01, gt=0, description="SGD lr of the calibration",
                                      json_schema_extra=float_range(0.001, 0.1, log=True))
        calibration_batch_size: int = Field(32, ge=1, description="mini-batch of the calibration")

    def check(self) -> None:
        check_linear_head(self.setup, self.name)
        if self.hyper.calibration == "last_round" and self.setup.rounds < 1:
            raise ConfigError("ccvr.calibration=last_round needs the run's number of rounds; use every_round")

    def calibrates(self, rnd: int) -> bool:
        calibration = self.hyper.calibration
        return calibration == "every_round" or (calibration == "last_round" and rnd == self.setup.rounds)

    # --- round ---------------------------------------------------------------------------------

    def init_server(self, params: Params) -> dict[str, Any]:
        return {"params": clone(params)}

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        return {cid: {"params": server["params"]} for cid in cids}

    def client_update(self, rnd: int, cid: int, client: Any, message: Message, data: ClientData) -> ClientUpdate:
        reply: Message = {}
        if self.calibrates(rnd):  # eqs. (1)-(2) on the downloaded model, before it trains
            features = self.setup.ops_for(cid).features(message["params"], data.x_train, data.buffers,
                                                        chunk=FEATURE_CHUNK).reshape(data.n_train, -1)
            reply["statistics"] = class_statistics(features, data.y_train.long())
        params = yield Fit(message["params"])
        return client, {"params": params, "weight": data.n_train, **reply}

    def start_aggregation(self, rnd: int, server: dict, cids: list[int]) -> Aggregation:
        counts = self.setup.train_counts
        weights = {cid: float(counts[cid].sum()) for cid in cids}
        if not self.calibrates(rnd):
            return SampleWeightedMean("params", weights, lambda mean: {"params": mean}, server)
        mean = SampleWeightedMean("params", weights, lambda mean: mean, None)
        return CalibratingRound(mean, lambda params, statistics: {
            "params": params, "calibrated": self.calibrate(rnd, server["params"], statistics)}, server)

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        """The batch form of `start_aggregation` (the same folds, in client order)."""
        aggregation = self.start_aggregation(rnd, server, sorted(replies))
        for cid in sorted(replies):
            aggregation.add(cid, replies[cid])
        return aggregation.finish()

    def calibrate(self, rnd: int, params: Params, statistics: dict[int, Statistics]) -> Params:
        """Eqs. (3)-(6): the model `params` (the one the clients computed statistics on) with its
        classifier re-trained on virtual features of the classes that have statistics."""
        head = select(params, "head")
        weight_name, bias_name = linear_layer_names(head, "head")
        totals, means, covariances = pooled_statistics(list(statistics.values()), self.setup.num_classes)
        present = torch.nonzero(totals > 0).flatten()
        generator = torch_generator(self.setup.seed, rnd, SERVER, "ccvr-virtual")
        hyper = self.hyper
        virtual = sample_virtual_features(means[present], covariances[present], hyper.virtual_per_class, generator)
        features = virtual.reshape(-1, virtual.shape[-1])
        labels = torch.arange(len(present)).repeat_interleave(hyper.virtual_per_class)
        weight, bias = head[weight_name][present], head[bias_name][present] if bias_name else None
        new_weight, new_bias = retrain_classifier(features, labels, weight, bias, epochs=hyper.calibration_epochs,
                                                  lr=hyper.calibration_lr, batch_size=hyper.calibration_batch_size,
                                                  generator=generator)
        self.record(rnd, "calibrated_classes", len(present))
        self.record(rnd, "virtual_loss_before", mean_cross_entropy(features, labels, weight, bias))
        self.record(rnd, "virtual_loss_after", mean_cross_entropy(features, labels, new_weight, new_bias))
        calibrated = {weight_name: head[weight_name].clone()}
        calibrated[weight_name][present] = new_weight
        if bias_name:
            calibrated[bias_name] = head[bias_name].clone()
            calibrated[bias_name][present] = new_bias
        return merge(select(params, "body"), calibrated)

    def client_model(self, cid: int, server: dict, client: Any) -> Params:
        """The calibrated model of the last calibrating round; FedAvg's model before any."""
        return server.get("calibrated", server["params"])
