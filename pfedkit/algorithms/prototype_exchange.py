"""The class-feature (prototype) exchange shared by pFedPM, R-pFedPM (`pfedpm.py`) and FedProto
(`fedproto.py`): clients never send weights; after local training each client uploads, per class
it owns, the mean body output over its training samples of that class (pFedPM eq. 6) and the
class's sample count; the server averages them per class into global features (eq. 7, with one
of three weightings) and sends every global feature it has down. Classes nobody uploaded in a
round keep their previous global feature. Each client keeps its own model and is evaluated with it.

What each method adds stays in its own file: pFedPM mixes its previous local feature with the
global one (eq. 8) and R-pFedPM scores (feature, class feature) pairs with a relation module;
FedProto pulls to the global prototype itself (a = 0) and predicts by the nearest one.

- `PrototypeExchange`: the Algorithm mixin (before `Algorithm` in the bases) with the shared
  hooks: server state, broadcast, eq. (6) local features and the upload, eq. (7) aggregation (and
  its diagnostics "local_global_distance" and "global_classes"), the client's own model, the
  feature-dimension check of heterogeneous models, the refusal of new clients. It reads
  `self.hyper.global_feature_weighting`.
- `PrototypeOptions`: the options every prototype method has (lam, global_feature_weighting,
  regulariser), declared once; each method's `Hyper` extends it (FedProto changes one default).
- the math both use: `global_features` (eq. 7), the regularisers of eq. (9) / (11) and
  `prototype_loss` (CE + lambda R), `feature_distance` (diagnostic).

Spec, equation numbers and paper-vs-code tables: `pfedpm.py`, docs/algorithms/pfedpm.md and
docs/algorithms/fedproto.md.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from pydantic import Field

from pfedkit.algorithms.prototypes import FeatureTable, class_means, message_to_table, table_to_message
from pfedkit.core.contract import ClientData, Forward, HyperParams, Message, cross_entropy
from pfedkit.core.errors import ConfigError
from pfedkit.core.params import Params
from pfedkit.core.search import float_range

FEATURE_CHUNK = 512  # samples per forward when computing local features (memory bound only)

GlobalFeatureWeighting = Literal["count", "uniform", "printed"]


def global_feature_weighting(default: GlobalFeatureWeighting):
    """The `global_feature_weighting` option with a method's default (eq. 7's server average)."""
    return Field(default, description="eq. (7), the server's average of a class's uploaded features: weighted "
                 "by class counts, plain mean over the uploaders (FedProto's code, PFLlib), or FedProto's "
                 "printed formula (count-weighted mean divided by the number of uploaders)")


class PrototypeOptions(HyperParams):
    """The options of every prototype-exchanging method (FedProto, pFedPM, R-pFedPM).

    lam: weight of the feature regulariser (pFedPM eq. 9's lambda, FedProto's); 1 for MNIST and
       FEMNIST, 0.1 on CIFAR-10 in both papers.
    global_feature_weighting: "count" = eq. (7) normalised by the class's sample counts [ours: the
       printed FedProto formula made to sum to one]; "uniform" = plain mean over the uploading
       clients [code: FedProto, PFLlib]; "printed" = FedProto's printed formula as is
       (count-weighted mean divided by the number of uploaders |N_c|) [paper].
    regulariser: "sample_mse" = mean over the batch's B samples and d dimensions of
       (f(x_b) - target_{y_b})^2, a sample whose class has no target contributing 0 but counting
       in B (`prototypes.alignment_loss`) [code: FedProto; the papers' lambdas are tuned for it];
       "class_distance" = sum over the batch's classes of ||batch class mean - target_c||^2
       (pFedPM eq. 11, FedProto's L_R as printed) [paper].
    """
    lam: float = Field(1.0, ge=0, description="weight of the feature (prototype) regulariser (pFedPM eq. 9's lambda)",
                       json_schema_extra=float_range(0.1, 10.0, log=True))
    global_feature_weighting: GlobalFeatureWeighting = global_feature_weighting("count")
    regulariser: Literal["sample_mse", "class_distance"] = Field(
        "sample_mse", description="per-sample MSE to the target feature of the sample's class (FedProto's code) "
        "or squared distance of the batch's class means to the targets (pFedPM eq. 11, FedProto's L_R)")

# Features travel as {class label: tensor [d]}; a table is the dense form ([C, d] + mask [C]).


# ---------------------------------------------------------------------------------------------
# The math (pure functions)


def global_features(uploads: Sequence[tuple[Mapping[int, torch.Tensor], Mapping[int, int]]],
                    weighting: str = "count") -> tuple[dict[int, torch.Tensor], dict[int, int]]:
    """Eq. (7) over the uploads that contain class c (N_c = those clients, n_c = sum_i n_{i,c}):

        "count":   C̄^(c) = sum_{i in N_c} n_{i,c} C_i^(c) / n_c      (default [ours], sums to one)
        "uniform": C̄^(c) = (1/|N_c|) sum_{i in N_c} C_i^(c)            (FedProto's code)
        "printed": C̄^(c) = (1/|N_c|) sum_{i in N_c} (n_{i,c}/n_c) C_i^(c)  (FedProto's printed
                   formula, which the paper's prose follows: "count" shrunk by 1/|N_c|)

    Returns ({c: C̄^(c)}, {c: n_c}); a class nobody uploaded is absent. Accumulated in float64, so
    the result does not depend on the order of the uploads beyond float32 rounding of the final value.
    """
    if weighting not in ("count", "uniform", "printed"):
        raise ValueError(f"global_feature_weighting must be 'count', 'uniform' or 'printed', got {weighting!r}")
    sums: dict[int, torch.Tensor] = {}
    weights: dict[int, float] = {}
    totals: dict[int, int] = {}
    uploaders: dict[int, int] = {}
    for features, counts in uploads:
        for label, feature in features.items():
            count = int(counts[label])
            weight = 1.0 if weighting == "uniform" else float(count)
            sums[label] = sums.get(label, 0) + weight * feature.double()
            weights[label] = weights.get(label, 0.0) + weight
            totals[label] = totals.get(label, 0) + count
            uploaders[label] = uploaders.get(label, 0) + 1
    dtype = next((f.dtype for features, _ in uploads for f in features.values()), torch.float32)
    shrink = {label: (uploaders[label] if weighting == "printed" else 1) for label in sums}
    means = {label: (sums[label] / (weights[label] * shrink[label])).to(dtype) for label in sorted(sums)}
    return means, {label: totals[label] for label in sorted(totals)}


def prototype_regulariser(features: torch.Tensor, labels: torch.Tensor, mixed: torch.Tensor,
                          has_mixed: torch.Tensor) -> torch.Tensor:
    """Eq. (9)'s R_i: MSE between f(x_b) and Ĉ^(y_b) over the samples whose class has a mixed
    feature (mean over those samples and the d dimensions); 0 when none has one.

    Written as a masked sum (no boolean indexing or data-dependent branch) so that it runs under
    torch.vmap in the vectorized runtime. Depends on the body output only, so its gradient never
    reaches the decision head.
    """
    selected = has_mixed[labels].to(features.dtype)  # [B]
    squared = ((features - mixed[labels]) ** 2).sum(dim=1)
    return (selected * squared).sum() / (selected.sum().clamp(min=1.0) * features.shape[1])


def class_distance_regulariser(features: torch.Tensor, labels: torch.Tensor, mixed: torch.Tensor,
                               has_mixed: torch.Tensor) -> torch.Tensor:
    """Eq. (11) read literally: L_R = sum_{c} ||C_i^(c) - Ĉ_i^(c)||^2 (squared Euclidean distance),
    over the classes c of the mini-batch that have a mixed feature, where C_i^(c) is the mean
    feature of the batch's class-c samples (the mini-batch estimate of eq. 6). 0 when none has one.

    Masked sums only (no boolean indexing), so it runs under torch.vmap like `prototype_regulariser`.
    """
    classes = torch.arange(mixed.shape[0], device=labels.device)
    member = (labels.unsqueeze(1) == classes.unsqueeze(0)).to(features.dtype)  # [B, C]
    counts = member.sum(dim=0)  # [C]
    means = (member.transpose(0, 1) @ features) / counts.clamp(min=1.0).unsqueeze(1)  # [C, d]
    selected = ((counts > 0) & has_mixed).to(features.dtype)
    return (selected * ((means - mixed) ** 2).sum(dim=1)).sum()


REGULARISERS = {"sample_mse": prototype_regulariser, "class_distance": class_distance_regulariser}


def prototype_loss(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any], *,
                   lam: float, regulariser: str = "sample_mse") -> torch.Tensor:
    """Eq. (9): CE + lam * R_i, R_i one of `REGULARISERS` ("sample_mse": `prototype_regulariser`,
    FedProto's per-sample form; "class_distance": `class_distance_regulariser`, eq. 11 literally).

    context: "mixed" [C, d], each class's target feature (pFedPM's eq. 8 mix; FedProto's global
    prototype, the mix at a = 0), and "has_mixed" [C], which classes have one. lam = 0 is exactly
    the cross-entropy (Local training)."""
    loss = cross_entropy(out, y, params, context)
    if lam:
        loss = loss + lam * REGULARISERS[regulariser](out.features, y, context["mixed"], context["has_mixed"])
    return loss


def feature_distance(features: Mapping[int, torch.Tensor], reference: Mapping[int, torch.Tensor]) -> float:
    """Mean over the uploaded classes of ||C_i^(c) - C̄^(c)||_2 (diagnostic; nan if no class)."""
    distances = [float(torch.linalg.vector_norm(feature - reference[label]))
                 for label, feature in features.items() if label in reference]
    return float(np.mean(distances)) if distances else float("nan")


# ---------------------------------------------------------------------------------------------
# The shared hooks


class PrototypeExchange:
    """Mixin: the hooks pFedPM, R-pFedPM and FedProto share (module docstring). Server state: the
    global features C̄ [C, d], which classes have one, and N_c; client state: at least "params",
    the client's own model (never uploaded)."""
    supports_heterogeneous_models: ClassVar[bool] = True  # only features travel (pFedPM-mh, spec §2.9)
    head: ClassVar[str] = "last"  # body = up to the 50-d fc1 feature, decision head = fc2 (spec §2.2)

    def __init__(self, hyper: HyperParams, setup) -> None:
        super().__init__(hyper, setup)
        self.feature_dim = int(setup.ops.template.feature_dim)

    def check(self) -> None:
        """Only d-dimensional features travel (pFedPM-mh), so every client's architecture must
        produce the default architecture's d: a mismatch would fail in the server's eq. (7)."""
        dims = {cid: int(self.setup.ops_for(cid).template.feature_dim) for cid in range(self.setup.num_clients)}
        odd = sorted(cid for cid, dim in dims.items() if dim != self.feature_dim)
        if odd:
            raise ConfigError(
                f"client_model_options: {self.name} exchanges d-dimensional features, so every client's model "
                f"needs the feature dimension of model_options' model (d = {self.feature_dim}); clients {odd} "
                f"have d = {sorted({dims[c] for c in odd})}; change their options so that d is {self.feature_dim}")

    def init_server(self, params: Params) -> dict[str, torch.Tensor]:
        """Global features C̄ [C, d], which classes have one, and N_c (none before round 1)."""
        c, d = self.setup.num_classes, self.feature_dim
        return {"features": torch.zeros(c, d), "present": torch.zeros(c, dtype=torch.bool),
                "counts": torch.zeros(c, dtype=torch.int64)}

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        """All global features known (R-pFedPM needs those of classes a client lacks too)."""
        down = {"features": table_to_message(server["features"], server["present"])}
        return {cid: down for cid in cids}

    def received(self, message: Message) -> FeatureTable:
        """The downloaded global features as a table ([C, d], present [C]); none before round 1."""
        return message_to_table(message.get("features", {}), self.setup.num_classes, self.feature_dim)

    def local_features(self, params: Params, data: ClientData) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Body outputs of the training data (eval mode, no grad) and eq. (6) -> (h, means, counts).

        Run with the client's own BatchNorm statistics (`data.buffers`, as they are after its
        latest Fit), the statistics its model predicts with, not the template's initial ones.
        """
        ops, buffers = self.setup.ops_for(data.cid), data.buffers
        features = (ops.features(params, data.x_train, buffers, chunk=FEATURE_CHUNK).float() if data.n_train
                    else torch.zeros(0, self.feature_dim))
        means, counts = class_means(features, data.y_train, self.setup.num_classes)
        return features, means, counts

    @staticmethod
    def upload(means: torch.Tensor, counts: torch.Tensor) -> Message:
        """Spec §2.5 step 4: {(c, C_i^(c), n_{i,c})} for the owned classes: |classes| (d + 1) numbers."""
        present = counts > 0
        return {"features": table_to_message(means, present),
                "counts": {int(c): int(counts[c]) for c in present.nonzero().squeeze(1).tolist()}}

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, torch.Tensor]:
        """Eq. (7) over this round's uploads; classes nobody uploaded keep their previous feature."""
        if not replies:
            return server
        ordered = sorted(replies)
        means, totals = global_features([(replies[c]["features"], replies[c]["counts"]) for c in ordered],
                                        self.hyper.global_feature_weighting)
        server = {name: value.clone() for name, value in server.items()}
        for label, feature in means.items():
            server["features"][label] = feature
            server["present"][label] = True
            server["counts"][label] = totals[label]
        current = table_to_message(server["features"], server["present"])
        distances = np.full(self.setup.num_clients, np.nan)
        for cid in ordered:
            distances[cid] = feature_distance(replies[cid]["features"], current)
        self.record(rnd, "local_global_distance", distances)
        self.record(rnd, "global_classes", int(server["present"].sum()))
        return server

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        """The client's own model: pFedPM predicts with its decision head (spec §2.5); R-pFedPM and
        FedProto pass its body's features to their own `predict`."""
        return client["params"]

    def new_client_refusal(self) -> str:
        """pFedPM and FedProto: models are private and only class features travel; a newcomer has
        an untrained body whose features the shared ones do not describe."""
        return ("models are private and only class features travel; a newcomer's untrained body does not "
                "produce the feature space those features describe")
