"""kNN-Per (Marfoq, Neglia, Kameni, Vidal, *Personalized Federated Learning through Local
Memorization*, ICML 2022): a FedAvg global model, interpolated at inference with a k-nearest-
neighbour model over a local datastore of (embedding, label) pairs from the client's training data.

Training is FedAvg (`MeanOfUploads`). At each evaluation every client builds its datastore: the
embeddings phi(x_j) of its training samples (the body's output) under the model it is evaluated
with, and their labels y_j (`evaluation_state`, on the client's side). A client predicts

    p(y | x) = lam * p_kNN(y | x) + (1 - lam) * softmax(h(phi(x)))_y                      (1)
    p_kNN(y | x) = sum_{j in N_k(x)} w_j 1[y_j = y] / sum_{j in N_k(x)} w_j,
    w_j = exp(-||phi(x) - phi(x_j)||^2 / (d * sigma))                                       (2)

with N_k(x) the k stored embeddings nearest to phi(x) (squared Euclidean distance, d the
embedding size, sigma `scale`), phi and h the evaluated model's body and head: the global model
(or a newcomer's fine-tuned copy of it). The datastore and the queries come from the same model,
as in the paper and both implementations. `lam = 0` is the global model's prediction exactly
(`interpolate="probabilities"`: log-softmax of its logits).

Client state: none (the datastore lives for one evaluation). Evaluated model: the global model,
predicting with (1). Communication: FedAvg's.
"""
from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from pfedkit.algorithms.registry import register
from pfedkit.core.aggregation import MeanOfUploads
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, HyperParams, Message
from pfedkit.core.params import Params, clone
from pfedkit.core.search import choices, float_range, int_range

TINY = 1e-12  # floor of a mixed probability before its log: a class the mixture gives 0 costs log(TINY), not inf


def knn_distribution(queries: torch.Tensor, keys: torch.Tensor, labels: torch.Tensor, *, k: int, scale: float,
                     num_classes: int) -> torch.Tensor:
    """p_kNN [B, C] of eq. (2): kernel-weighted label frequencies among the k nearest keys.

    The weights are taken relative to the nearest neighbour, exp(-(d_j - d_min) / (d sigma)):
    the normalised distribution is the same, and a query far from every key cannot underflow
    to 0 / 0."""
    distances = torch.cdist(queries.float(), keys.float(), compute_mode="donot_use_mm_for_euclid_dist") ** 2
    nearest, positions = distances.topk(min(k, keys.shape[0]), dim=1, largest=False)
    weights = torch.exp(-(nearest - nearest[:, :1]) / (queries.shape[1] * scale))
    votes = torch.zeros(queries.shape[0], num_classes, dtype=weights.dtype)
    votes.scatter_add_(1, labels[positions], weights)
    return votes / weights.sum(dim=1, keepdim=True)


def interpolated_logits(model_logits: torch.Tensor, knn: torch.Tensor, lam: float, interpolate: str) -> torch.Tensor:
    """What the client predicts with, as logits (the evaluator's cross-entropy reads them):
    "probabilities": log(lam p_kNN + (1 - lam) softmax(z)) (eq. 1, the paper);
    "logits": lam p_kNN + (1 - lam) z (the authors' code and FL-bench mix p_kNN with raw logits)."""
    if interpolate == "logits":
        return lam * knn + (1 - lam) * model_logits
    if lam == 0:
        return F.log_softmax(model_logits, dim=1)
    mixed = lam * knn + (1 - lam) * F.softmax(model_logits, dim=1)
    return torch.log(mixed.clamp_min(TINY))


@register
class KNNPer(MeanOfUploads, Algorithm):
    name = "knnper"
    description = "kNN-Per: FedAvg model interpolated with a kNN model over each client's datastore of embeddings"
    evaluated_model = "custom"  # the global model, its softmax mixed with the client's kNN distribution

    class Hyper(HyperParams):
        """kNN-Per options. k: 7 (the authors' experiment scripts; FL-bench 5). lam: one weight for
        every client [ours; the paper and code scan a grid of lam per client on test data].
        scale: sigma of eq. (2) (the code's kernel length scale, 1). interpolate: the paper's
        probabilities, or the code's probabilities-with-logits mix."""
        k: int = Field(7, ge=1, description="neighbours N_k(x) taken from the client's datastore",
                       json_schema_extra=int_range(1, 20))
        lam: float = Field(0.5, ge=0, le=1, description="lambda: weight of the kNN distribution in the "
                           "interpolation (0: the global model alone)", json_schema_extra=float_range(0.0, 1.0))
        scale: float = Field(1.0, gt=0, description="sigma: kernel length scale, w = exp(-dist^2 / (d sigma))",
                             json_schema_extra=float_range(0.1, 10.0, log=True))
        interpolate: Literal["probabilities", "logits"] = Field(
            "probabilities", description="mix p_kNN with the model's probabilities (paper) or its logits (code)",
            json_schema_extra=choices("probabilities", "logits"))

    def init_server(self, params: Params) -> dict[str, Any]:
        return {"params": clone(params)}

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        return {cid: {"params": server["params"]} for cid in cids}

    def client_update(self, rnd: int, cid: int, client: None, message: Message, data: ClientData) -> ClientUpdate:
        trained = yield Fit(message["params"])
        return client, {"params": trained, "weight": data.n_train}

    def client_model(self, cid: int, server: dict, client: None) -> Params:
        return server["params"]

    def evaluation_state(self, cid: int, server: dict, client: None, params: Params,
                         data: ClientData) -> dict[str, Any]:
        """The datastore: the training set embedded by the evaluated model `params` (with the
        BatchNorm statistics it is evaluated with), its labels, and the model whose head predicts."""
        keys = self.setup.ops_for(cid).features(params, data.x_train, data.buffers, chunk=1000)
        return {"params": params, "keys": keys, "labels": data.y_train}

    def predict(self, cid: int, server: dict, client: dict, features: torch.Tensor) -> torch.Tensor:
        """Eq. (1) on the evaluated model's embeddings; an empty datastore (a client without
        training data) predicts with the model alone (lam = 0)."""
        model_logits = self.setup.ops_for(cid).head_logits(client["params"], features)
        if client["keys"].shape[0] == 0:
            return interpolated_logits(model_logits, model_logits, 0.0, self.hyper.interpolate)
        knn = knn_distribution(features, client["keys"], client["labels"], k=self.hyper.k, scale=self.hyper.scale,
                               num_classes=model_logits.shape[1])
        return interpolated_logits(model_logits, knn, self.hyper.lam, self.hyper.interpolate)
