"""FedNH (Dai, Chen, Li, Heinecke, Sun, Xu, *Tackling Data Heterogeneity in Federated Learning with
Class Prototypes*, AAAI 2023; code Yutong-Dai/FedNH; spec baselines.md "FedNH").

The classifier is a matrix of class prototypes mu in R^{C x D} (the model's last Linear weight,
unit-norm rows; its bias is unused and kept at 0), initialised orthogonally (seeded) and never
trained by the clients. Logits are s * <h/||h||, mu_c> with a scalar scale s learned with the body.

Round t:
  1. The server sends the global model: body, mu and s (s only when learned).
  2. A participant trains the body (and s) E epochs on CE of the cosine logits; mu stays frozen.
     The paper clips gradients at norm 10: set the run config's `grad_clip: 10` (not forced here).
  3. It uploads the body, s, and per class c it owns r_{i,c} = n_{i,c} normalize(m_{i,c}) with
     m_{i,c} = mean over its class-c training samples of h(x)/||h(x)|| (one eval-mode pass after
     training), plus the counts n_{i,c}.
  4. The server sets body and s to the plain mean over the participants (server lr 1) and, for
     every class with data this round, avg_c = normalize(sum_i r_{i,c} / sum_i n_{i,c}),
     mu_c <- normalize(rho mu_c + (1 - rho) avg_c); the other classes keep mu_c.

Client state: none (`evaluate="global"`), or its model and s after its latest local training
(`evaluate="personal"`). Evaluated: the global model (GM) or that personal model (PM), predicting
with the cosine logits of the evaluated model's mu (a newcomer's: the head its fine-tuning
trained). Communication: down body + C*D (+ s); up body (+ s) + (#own classes) * D
floats + one count per class. Paper-vs-code table: docs/algorithms/fednh.md.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from pfedkit.algorithms.prototypes import table_to_message
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, Forward, HyperParams, Message
from pfedkit.core.errors import ConfigError
from pfedkit.core.params import Params, clone, linear_layer_names, merge, select, weighted_mean
from pfedkit.core.seeds import SERVER, torch_generator
from pfedkit.core.search import float_range

FEATURE_CHUNK = 512  # samples per forward when computing the class prototypes (memory bound only)
SCALE = "scale"  # name of s among a Fit's extra tensors


# ---------------------------------------------------------------------------------------------
# The math (pure functions)


def initial_prototypes(num_classes: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """mu^0: torch.nn.init.orthogonal_ on a [C, D] matrix (orthonormal rows when C <= D), rows then
    scaled to unit norm (needed when C > D)."""
    matrix = torch.empty(num_classes, dim)
    torch.nn.init.orthogonal_(matrix, generator=generator)
    return F.normalize(matrix, dim=1)


def cosine_logits(features: torch.Tensor, prototypes: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """z_{b,c} = s * <h_b/||h_b||, mu_c/||mu_c||> -> [B, C]."""
    return scale * (F.normalize(features, dim=1) @ F.normalize(prototypes, dim=1).T)


def fednh_loss(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any], *,
               weight_name: str) -> torch.Tensor:
    """Mean CE of the cosine logits of the body features against mu = params[weight_name] (frozen)
    and s = params["scale"] when learned (a Fit extra), else context["scale"]."""
    scale = params[SCALE] if SCALE in params else context[SCALE]
    return F.cross_entropy(cosine_logits(out.features, params[weight_name], scale), y)


def class_prototype_sums(features: torch.Tensor, labels: torch.Tensor,
                         num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """r_c = n_c * normalize(m_c), m_c = (1/n_c) sum_{y=c} h/||h||, for every class -> ([C, D], n [C]);
    rows of classes without samples are 0."""
    counts = torch.bincount(labels, minlength=num_classes)
    sums = torch.zeros(num_classes, features.shape[1], dtype=torch.float64)
    sums.index_add_(0, labels, F.normalize(features.double(), dim=1))
    means = sums / counts.clamp(min=1).unsqueeze(1)
    return (counts.unsqueeze(1) * F.normalize(means, dim=1)).to(features.dtype), counts


def update_prototypes(prototypes: torch.Tensor, sums: torch.Tensor, counts: torch.Tensor, rho: float) -> torch.Tensor:
    """For classes with counts_c = sum_i n_{i,c} > 0: avg_c = normalize(sums_c / counts_c) with
    sums_c = sum_i r_{i,c}, and mu_c <- normalize(rho mu_c + (1 - rho) avg_c); others keep mu_c."""
    average = F.normalize(sums.double() / counts.clamp(min=1).unsqueeze(1), dim=1)
    moved = F.normalize(rho * prototypes.double() + (1.0 - rho) * average, dim=1).to(prototypes.dtype)
    return torch.where((counts > 0).unsqueeze(1), moved, prototypes)


def upload_sums(uploads: Sequence[tuple[Mapping[int, torch.Tensor], Mapping[int, int]]], num_classes: int,
                dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_i r_{i,c} (float64 [C, D]) and sum_i n_{i,c} [C] over the uploads ({c: r}, {c: n})."""
    sums = torch.zeros(num_classes, dim, dtype=torch.float64)
    counts = torch.zeros(num_classes, dtype=torch.int64)
    for vectors, numbers in uploads:
        for label, vector in vectors.items():
            sums[int(label)] += vector.double()
            counts[int(label)] += int(numbers[label])
    return sums, counts


# ---------------------------------------------------------------------------------------------
# The algorithm


@register
class FedNH(Algorithm):
    name = "fednh"
    description = "FedNH: frozen unit-norm class-prototype classifier, prototypes moved to the clients' class means"
    evaluated_model = "custom"  # global body + the server's prototypes as head, scored with its scale
    head = "last"

    class Hyper(HyperParams):
        """FedNH hyperparameters (baselines.md "FedNH").

        rho: momentum of the prototype update, 0.9 [paper]; 1 keeps the initial prototypes.
        scale_init: initial s, 1.0 (the paper's CNN) [code: FedNH]; 20 for its ResNets.
        learn_scale: True = s is learned with the body and averaged by the server [paper];
           False = s fixed at scale_init (the code's fixed-30 variant: scale_init=30).
        evaluate: "global" = the global model (GM) [paper, default]; "personal" = each client's
           model after its latest local training (PM, the paper's PFL tables).
        record_prototypes_every: record mu every this many rounds (and at the last round) for the
           report: C * D floats each time [ours].
        """
        rho: float = Field(0.9, ge=0, le=1, description="prototype momentum (1: prototypes never move)",
                           json_schema_extra=float_range(0.5, 0.99))
        scale_init: float = Field(1.0, gt=0, description="initial (or fixed) scale s of the cosine logits")
        learn_scale: bool = Field(True, description="learn s with the body (False: keep scale_init)")
        evaluate: Literal["global", "personal"] = Field(
            "global", description="evaluate the global model (GM) or each client's model after its local training (PM)")
        record_prototypes_every: int = Field(1, ge=1, description="record the prototype matrix every k rounds")

    def __init__(self, hyper: HyperParams, setup) -> None:
        super().__init__(hyper, setup)
        try:
            self.weight_name, self.bias_name = linear_layer_names(select(setup.ops.initial_params(), "head"), "head")
            self.head_error = ""
        except ValueError as error:
            self.weight_name, self.bias_name, self.head_error = "", None, str(error)

    def check(self) -> None:
        """The head must be one Linear layer of shape [C, D]: it holds the prototypes."""
        if self.head_error:
            raise ConfigError(f"fednh: the model's head must be a single Linear layer (the prototype matrix): "
                              f"{self.head_error}; use a model whose last layer is a Linear classifier")

    # -- state ---------------------------------------------------------------------------------

    def global_params(self, body: Params, prototypes: torch.Tensor) -> Params:
        """The full model: body + head weight mu (+ a zero bias)."""
        head = {self.weight_name: prototypes}
        if self.bias_name is not None:
            head[self.bias_name] = torch.zeros(prototypes.shape[0], dtype=prototypes.dtype)
        return merge(body, head)

    def init_server(self, params: Params) -> dict[str, Any]:
        c, d = params[self.weight_name].shape
        generator = torch_generator(self.setup.seed, 0, SERVER, "fednh-prototypes")
        return {"body": clone(select(params, "body")), "prototypes": initial_prototypes(c, d, generator),
                "scale": torch.tensor(float(self.hyper.scale_init))}

    def init_client(self, cid: int, params: Params) -> None:
        """Nothing until the client trains (then, with evaluate="personal", its model and s)."""
        return None

    # -- round ---------------------------------------------------------------------------------

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        down = {"body": server["body"], "prototypes": server["prototypes"]}
        if self.hyper.learn_scale:
            down["scale"] = server["scale"]
        return {cid: down for cid in cids}

    def local_fit(self, message: Message) -> Fit:
        """Body (+ s) trained on the cosine-logit CE; the head (mu, zero bias) is frozen."""
        params = self.global_params(message["body"], message["prototypes"])
        loss = partial(fednh_loss, weight_name=self.weight_name)
        if self.hyper.learn_scale:
            return Fit(params, loss=loss, trainable="body", extra={SCALE: message["scale"].clone()})
        return Fit(params, loss=loss, trainable="body", context={SCALE: torch.tensor(float(self.hyper.scale_init))})

    def client_update(self, rnd: int, cid: int, client: Any, message: Message, data: ClientData) -> ClientUpdate:
        trained = yield self.local_fit(message)
        params = {name: value for name, value in trained.items() if name != SCALE}
        scale = trained[SCALE] if self.hyper.learn_scale else torch.tensor(float(self.hyper.scale_init))
        sums, counts = self.class_sums(params, data)
        owned = counts > 0
        reply = {"body": select(params, "body"), "prototypes": table_to_message(sums, owned),
                 "counts": {int(c): int(counts[c]) for c in owned.nonzero().squeeze(1).tolist()}}
        if self.hyper.learn_scale:
            reply["scale"] = scale
        state = {"params": params, "scale": scale} if self.hyper.evaluate == "personal" else None
        return state, reply

    def class_sums(self, params: Params, data: ClientData) -> tuple[torch.Tensor, torch.Tensor]:
        """`class_prototype_sums` of the trained body's outputs (eval mode, the client's BatchNorm
        statistics) on the client's training data."""
        c, d = params[self.weight_name].shape
        if not data.n_train:
            return torch.zeros(c, d), torch.zeros(c, dtype=torch.int64)
        features = self.setup.ops.features(params, data.x_train, data.buffers, chunk=FEATURE_CHUNK).float()
        return class_prototype_sums(features, data.y_train, c)

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        """Body and s: plain mean over the participants; mu: `update_prototypes` with rho."""
        if not replies:
            return server
        ordered = sorted(replies)
        ones = [1.0] * len(ordered)
        body = weighted_mean([replies[cid]["body"] for cid in ordered], ones)
        scale = (torch.stack([replies[cid]["scale"] for cid in ordered]).mean() if self.hyper.learn_scale
                 else server["scale"])
        c, d = server["prototypes"].shape
        sums, counts = upload_sums([(replies[cid]["prototypes"], replies[cid]["counts"]) for cid in ordered], c, d)
        prototypes = update_prototypes(server["prototypes"], sums, counts, self.hyper.rho)
        self.record(rnd, "scale", float(scale))
        shift = 1.0 - (prototypes * server["prototypes"]).sum(dim=1)
        self.record(rnd, "prototype_shift", shift.numpy())
        if rnd % self.hyper.record_prototypes_every == 0 or rnd == self.setup.rounds:
            self.record(rnd, "prototypes", prototypes.numpy().copy())
        return {"body": body, "prototypes": prototypes, "scale": scale}

    # -- evaluation ----------------------------------------------------------------------------

    def personal(self, client: Any) -> bool:
        return self.hyper.evaluate == "personal" and client is not None

    def client_model(self, cid: int, server: dict, client: Any) -> Params:
        """GM = body + mu (zero bias); PM = the client's model after its latest local training (a
        client that has not trained yet: the GM)."""
        if self.personal(client):
            return client["params"]
        return self.global_params(server["body"], server["prototypes"])

    def evaluation_state(self, cid: int, server: dict, client: Any, params: Params, data: ClientData) -> dict:
        """The mu and s that score this evaluation, the evaluated model's: mu is its head weight
        (the server's prototypes for GM, the client's for PM, the mu a participant trained with at
        `eval_point=after_local_training`, and for a newcomer the head its fine-tuning trained);
        s is the one it carries (a model right after training with a learned s), else the
        client's own (PM) or the server's."""
        if SCALE in params:
            scale = params[SCALE]
        else:
            scale = client["scale"] if self.personal(client) else server["scale"]
        return {"prototypes": params[self.weight_name], "scale": scale}

    def predict(self, cid: int, server: dict, client: dict, features: torch.Tensor) -> torch.Tensor:
        """The cosine logits with the evaluated model's mu and s (`evaluation_state`; the head
        output lacks the feature normalisation)."""
        return cosine_logits(features, client["prototypes"], client["scale"])
