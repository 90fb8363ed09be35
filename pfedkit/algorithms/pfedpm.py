"""pFedPM and R-pFedPM (Xing et al., *Personalized federated learning based on feature fusion*,
CSCWD 2024; seed spec §2). Every formula is [recon]: the paper's equations were lost, the spec
rebuilt them from its prose, FedProto (Tan et al., AAAI 2022) and Relation Networks (Sung et al.,
CVPR 2018). Equation numbers below are the paper's, as the spec numbers them.

Clients never send weights. After local training each client uploads, per class it owns, the mean
body output of that class (its local feature, eq. 6) and the class's sample count; the server
averages them per class into global features (eq. 7) and sends all of them down. Before training,
a client mixes its previous local feature with the received global one (eq. 8,
`a * local + (1 - a) * global`) and trains with cross-entropy plus lambda * MSE between each
sample's feature and the mixed feature of its class (eq. 9). pFedPM predicts with the model's own
decision head (fc2).

R-pFedPM ("rpfedpm") adds a relation module psi (pfedkit.models.relation) that scores
(sample feature, class feature) pairs and predicts the best-scoring class (eqs. 12-13); class
features are the mixed ones, or the global ones for classes without a mixed feature.

How R-pFedPM's relation module psi is trained: always by the engine's trainer, as `Fit.extra`
tensors named "relation.*" (its BatchNorm running statistics ride along and are updated in place
by the loss, as BatchNorm does in train mode), so the run's optimiser settings (lr, momentum,
weight decay, clipping, kept optimizer state) and every runtime apply to it.
  `relation_training=joint` (default; the paper: two heads "that share the same body", the spec:
     "trains psi jointly"): ONE Fit trains body, decision head and psi together by SGD on
     CE + lambda R + w * L_rel. `relation_detach_body=True` keeps L_rel's gradient out of the body.
  `relation_training=alternate` (the form before issue 22): a Fit trains body + decision head on
     CE + lambda R + w * L_rel with psi fixed (from the context; `relation_detach_body=True` drops
     the term), then a second Fit (`trainable="none"`, optimizer "relation") trains psi alone on
     w * L_rel over the new body's features, computed once in eval mode with the client's
     BatchNorm statistics and read per batch through `Forward.index`; `relation_epochs` epochs.

BatchNorm bodies (ResNet-18): every forward of a client's model outside training (local features
of eq. 6, the features of the alternate form's relation Fit) uses the client's own running
statistics, `data.buffers`, as they are after its latest Fit; evaluation loads the same statistics
into the evaluator's module before calling `predict` on its body features.

pFedPM-mh (clients with models of different architectures, spec §2.9): config
`client_model_options`; client features are computed with `setup.ops_for(cid)`, the client's own
architecture. Only d-dimensional features travel, so all architectures must share d (`check`).

The exchange itself (eqs. 6-7, server state, broadcast, the d check, the regularisers of eqs. 9
and 11) lives in `prototype_exchange.py`, shared with FedProto; this file holds eq. (8), the local
loss with R-pFedPM's relation term, and the relation module's training and prediction.

Paper-vs-code table: docs/algorithms/pfedpm.md.
"""
from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any, Literal

import torch
from pydantic import Field, field_validator, model_validator

from pfedkit.algorithms.prototype_exchange import PrototypeExchange, PrototypeOptions, prototype_loss
from pfedkit.algorithms.prototypes import FeatureTable
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, Forward, Message
from pfedkit.core.params import Params, clone
from pfedkit.core.seeds import SERVER, derive_seed
from pfedkit.core.search import float_range
from pfedkit.models.relation import RelationModule, relation_buffers, relation_params, relation_scores

UNAVAILABLE_SCORE = -1.0  # "logit" of a class without a class feature: below every score in (0, 1)
RELATION = "relation."  # psi's tensors in a Fit's extra (and its answer): "relation." + module name
RELATION_STATISTICS = ("bn.running_mean", "bn.running_var")  # psi's BatchNorm buffers (not trained)
# psi's own SGD settings before issue 22: it now trains in the engine's Fit with the run's.
REMOVED_RELATION_KEYS = {
    key: f"{key} was removed: the relation module now trains in the engine's Fit with the run's lr, momentum "
         "and batch_size; set those instead"
    for key in ("relation_lr", "relation_momentum", "relation_batch_size")}


# ---------------------------------------------------------------------------------------------
# The math (pure functions)


def mix_features(local: torch.Tensor, has_local: torch.Tensor, global_: torch.Tensor,
                 has_global: torch.Tensor, a: float) -> FeatureTable:
    """Eq. (8): Ĉ_i^(c) = a C_i^(c) + (1 - a) C̄^(c), defined only where both features exist
    (a class without one of them has no mixed feature, spec §2.5 step 2). -> (mixed [C, d], mask)."""
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"mixing weight a must lie in [0, 1], got {a}")
    has_mixed = has_local & has_global
    mixed = torch.where(has_mixed.unsqueeze(1), a * local + (1.0 - a) * global_, torch.zeros_like(local))
    return mixed, has_mixed


def relation_class_features(mixed: torch.Tensor, has_mixed: torch.Tensor, global_: torch.Tensor,
                            has_global: torch.Tensor) -> FeatureTable:
    """Eq. (12)'s class features: Ĉ_i^(c) where the client has a mixed feature, else C̄^(c);
    classes with neither are unavailable. -> (class features [C, d], available mask [C])."""
    chosen = torch.where(has_mixed.unsqueeze(1), mixed, global_)
    available = has_mixed | has_global
    return torch.where(available.unsqueeze(1), chosen, torch.zeros_like(chosen)), available


def relation_targets(labels: torch.Tensor, class_ids: torch.Tensor) -> torch.Tensor:
    """One-hot targets 1[y_b = c] over the available classes -> [B, K] float."""
    return (labels.unsqueeze(1) == class_ids.unsqueeze(0)).float()


def relation_loss(scores: torch.Tensor, labels: torch.Tensor, class_ids: torch.Tensor) -> torch.Tensor:
    """Eq. (13): L_rel = 1/(|B| |K_i|) sum_b sum_{c in K_i} (r_{b,c} - 1[y_b = c])^2
    (Sung et al.'s MSE to one-hot targets); scores [B, K] are ordered like class_ids [K]."""
    return ((scores - relation_targets(labels, class_ids)) ** 2).mean()


def relation_logits(scores: torch.Tensor, class_ids: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Scores [B, K] of the available classes as [B, C] "logits" whose argmax is
    argmax_{c in K_i} r_{b,c}: unavailable classes get UNAVAILABLE_SCORE, below every score."""
    logits = scores.new_full((scores.shape[0], num_classes), UNAVAILABLE_SCORE)
    logits[:, class_ids] = scores
    return logits


def relation_extra(psi: Mapping[str, torch.Tensor], statistics: Mapping[str, torch.Tensor]) -> Params:
    """psi and its BatchNorm running statistics as `Fit.extra` tensors ("relation." + name). SGD
    trains psi; the statistics get no gradient, so SGD carries them and the loss updates them."""
    return {RELATION + name: tensor for name, tensor in {**psi, **statistics}.items()}


def relation_from(params: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
    """(psi, statistics) out of a Fit's live tensors or its answer (the "relation." tensors)."""
    psi, statistics = {}, {}
    for name, tensor in params.items():
        if name.startswith(RELATION):
            local = name[len(RELATION):]
            (statistics if local in RELATION_STATISTICS else psi)[local] = tensor
    return psi, statistics


def without_relation(params: Mapping[str, torch.Tensor]) -> Params:
    """The model's parameters of a Fit's answer (the "relation." tensors left out)."""
    return {name: tensor for name, tensor in params.items() if not name.startswith(RELATION)}


def relation_term(features: torch.Tensor, y: torch.Tensor, params: Params, context: Mapping[str, Any]) -> torch.Tensor:
    """L_rel (eq. 13) of a mini-batch, psi in train mode (BatchNorm with the batch's statistics).

    psi is the Fit's own "relation." tensors when it trains them (their running statistics are
    updated in place, through `.detach()`: they get no gradient), else `context["relation"]`, held
    fixed. context: "class_features" [C, d] and "available" [C]."""
    class_ids = context["available"].nonzero().squeeze(1)
    psi, statistics = relation_from(params)
    if psi:
        statistics = {name: tensor.detach() for name, tensor in statistics.items()}
    else:
        psi, statistics = context["relation"], None
    scores = relation_scores(psi, features, context["class_features"][class_ids], training=True, buffers=statistics)
    return relation_loss(scores, y, class_ids)


def pfedpm_loss(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any], *,
                lam: float, relation_weight: float = 0.0, regulariser: str = "sample_mse",
                detach_body: bool = False) -> torch.Tensor:
    """Eq. (9) (+ R-pFedPM's relation term): CE + lam * R_i [+ relation_weight * L_rel].

    CE + lam * R_i is `prototype_exchange.prototype_loss` (regulariser: "sample_mse", FedProto's
    per-sample form, default, or "class_distance", eq. 11 literally).

    context: "mixed" [C, d] and "has_mixed" [C]; for the relation term also "class_features" and
    "available" (`relation_term`: psi trained in this Fit, or fixed in "relation"). detach_body:
    the relation term sees the features without their gradient, so it never reaches the body.
    lam = 0 and no relation term is exactly the cross-entropy (Local training).
    """
    loss = prototype_loss(out, y, params, context, lam=lam, regulariser=regulariser)
    if relation_weight and "class_features" in context:
        features = out.features.detach() if detach_body else out.features
        loss = loss + relation_weight * relation_term(features, y, params, context)
    return loss


def relation_only_loss(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any], *,
                       weight: float) -> torch.Tensor:
    """weight * L_rel over fixed features: `context["features"]` [n_train, d] (the body's eval-mode
    output, computed once) at the batch's positions. R-pFedPM's alternate form, psi's own Fit."""
    return weight * relation_term(context["features"][out.index], y, params, context)


@register
class PFedPM(PrototypeExchange, Algorithm):
    """The exchange (server state, broadcast, eq. 6-7, own model) is `PrototypeExchange`'s; here:
    the mix of eq. (8) and the local training of eq. (9)."""
    name = "pfedpm"
    description = "pFedPM: clients exchange per-class mean features; local loss pulls features to a local/global mix"
    evaluated_model = "own"

    class Hyper(PrototypeOptions):
        """pFedPM hyperparameters (seed spec §2.7): the prototype options (`PrototypeOptions`: lam,
        global_feature_weighting, regulariser; the target of eq. 9's R_i is the mixed feature of
        eq. 8), and:

        a: mixing weight of the local feature in eq. (8) (0: global feature only, FedProto's
           target; 1: own previous feature only). Spec default 0.4 [ours; FEMNIST n=4].
        prototype_source: "eval_pass" = local features from one no-grad eval-mode pass over the
           client's training data after training [ours]; "training_passes" (FedProto's code:
           features produced during the training passes) needs engine support and is refused.
        """
        a: float = Field(0.4, ge=0, le=1, description="mixing weight of the local feature (eq. 8)",
                         json_schema_extra=float_range(0.0, 1.0))
        prototype_source: Literal["eval_pass", "training_passes"] = Field(
            "eval_pass", description="how local features are computed (training_passes: not available)")

        @field_validator("prototype_source")
        @classmethod
        def _only_eval_pass(cls, value: str) -> str:
            if value == "training_passes":
                raise ValueError("prototype_source='training_passes' needs the engine to return the "
                                 "features of its training passes (a Fit feature-collection hook); "
                                 "use 'eval_pass'")
            return value

    # -- state ---------------------------------------------------------------------------------

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        """Own model (never uploaded) and the local features of its last participation."""
        c, d = self.setup.num_classes, self.feature_dim
        return {"params": clone(params), "local": torch.zeros(c, d), "has_local": torch.zeros(c, dtype=torch.bool)}

    # -- round ---------------------------------------------------------------------------------

    def received_and_mixed(self, client: dict, message: Message) -> tuple[FeatureTable, FeatureTable]:
        received = self.received(message)
        mixed = mix_features(client["local"], client["has_local"], *received, self.hyper.a)
        return received, mixed

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        _, (mixed, has_mixed) = self.received_and_mixed(client, message)
        params = yield Fit(client["params"], loss=partial(pfedpm_loss, lam=self.hyper.lam, regulariser=self.hyper.regulariser),
                           context={"mixed": mixed, "has_mixed": has_mixed})
        _, means, counts = self.local_features(params, data)
        return {"params": params, "local": means, "has_local": counts > 0}, self.upload(means, counts)


@register
class RPFedPM(PFedPM):
    name = "rpfedpm"
    description = "R-pFedPM: pFedPM with a per-client relation module scoring (feature, class feature) pairs"
    evaluated_model = "custom"  # own model, predicting by the relation module's scores
    removed_options = REMOVED_RELATION_KEYS

    class Hyper(PFedPM.Hyper):
        """R-pFedPM = pFedPM's hyperparameters plus the relation module's (seed spec §2.5-2.7).

        relation_training: "joint" (default): body, decision head and psi in one SGD on
           CE + lam R + relation_weight L_rel (the paper's heads "that share the same body", the
           spec's "trains psi jointly"); "alternate": body + head with psi fixed, then psi alone
           on the new body's eval-mode features (block-coordinate; the form before issue 22).
        relation_weight: weight of L_rel (eq. 13) in the local loss; not stated by the paper,
           1.0 [ours]. Must be > 0: with 0 the relation module, which makes R-pFedPM's
           predictions, would never learn.
        relation_detach_body: False [ours, "both heads share the body"]: the relation loss's
           gradient reaches the body; True: it does not (psi still trains on it).
        relation_epochs: alternate only: epochs of psi's own Fit (None: the run's local_epochs).
        psi trains with the run's lr, momentum, weight decay, clipping and batch size (the
        engine's Fit): the paper's optimiser is the run-level `lr=0.01 momentum=0.5 batch_size=10`.
        """
        relation_training: Literal["joint", "alternate"] = Field(
            "joint", description="joint: body, head and relation module in one SGD (paper: both heads share "
            "the body); alternate: body + head with the relation module fixed, then the module alone")
        relation_weight: float = Field(1.0, gt=0, description="weight of the relation loss (eq. 13); > 0, "
                                       "else the relation head that predicts never learns",
                                       json_schema_extra=float_range(0.1, 10.0, log=True))
        relation_detach_body: bool = Field(False, description="keep the relation loss's gradient out of the body")
        relation_epochs: int | None = Field(None, ge=1, description="relation_training=alternate: epochs of the "
                                            "relation module's own Fit (None: local_epochs)")

        @model_validator(mode="before")
        @classmethod
        def _removed_optimiser_keys(cls, values: Any) -> Any:
            removed = sorted(set(values) & set(REMOVED_RELATION_KEYS)) if isinstance(values, dict) else []
            if removed:
                raise ValueError(REMOVED_RELATION_KEYS[removed[0]])
            return values

        @model_validator(mode="after")
        def _epochs_need_alternate(self) -> "RPFedPM.Hyper":
            if self.relation_epochs is not None and self.relation_training != "alternate":
                raise ValueError("relation_epochs applies to relation_training=alternate only (joint trains the "
                                 "relation module in the local Fit, for local_epochs); drop it or set "
                                 "relation_training=alternate")
            return self

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        """pFedPM's state plus psi (same seeded initialisation on every client, never uploaded) and
        the class features of its last training, used for prediction."""
        state = super().init_client(cid, params)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.setup.seed, 0, SERVER, "relation-init"))
            module = RelationModule(self.feature_dim)
        c, d = self.setup.num_classes, self.feature_dim
        state.update({"relation": relation_params(module), "relation_stats": relation_buffers(module),
                      "class_features": torch.zeros(c, d), "available": torch.zeros(c, dtype=torch.bool)})
        return state

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        h = self.hyper
        received, (mixed, has_mixed) = self.received_and_mixed(client, message)
        class_features, available = relation_class_features(mixed, has_mixed, *received)
        psi, statistics = client["relation"], client["relation_stats"]
        context = {"mixed": mixed, "has_mixed": has_mixed}
        relation_context = {**context, "class_features": class_features, "available": available}
        loss = partial(pfedpm_loss, lam=h.lam, relation_weight=h.relation_weight, regulariser=h.regulariser,
                       detach_body=h.relation_detach_body)
        if not bool(available.any()):  # no class feature yet (round 1): psi has nothing to score
            params = yield Fit(client["params"], loss=partial(pfedpm_loss, lam=h.lam, regulariser=h.regulariser),
                               context=context)
        elif h.relation_training == "joint":
            trained = yield Fit(client["params"], loss=loss, context=relation_context,
                                extra=relation_extra(psi, statistics))
            params, (psi, statistics) = without_relation(trained), relation_from(trained)
        else:  # alternate, step 1: psi fixed in the context; detached, the term would be 0: left out
            fixed = {**relation_context, "relation": psi} if not h.relation_detach_body else context
            params = yield Fit(client["params"], loss=loss, context=fixed)
        features, means, counts = self.local_features(params, data)
        if bool(available.any()) and h.relation_training == "alternate":
            trained = yield self.relation_fit(params, psi, statistics, features, relation_context)
            psi, statistics = relation_from(trained)
        state = {"params": params, "local": means, "has_local": counts > 0, "relation": psi,
                 "relation_stats": statistics, "class_features": class_features, "available": available}
        return state, self.upload(means, counts)

    def relation_fit(self, params: Params, psi: Params, statistics: Params, features: torch.Tensor,
                     relation_context: dict[str, Any]) -> Fit:
        """Alternate form, step 2: psi alone (the model frozen) on relation_weight * L_rel over the
        body's eval-mode features of the training data, its own optimizer slot "relation"."""
        return Fit(params, loss=partial(relation_only_loss, weight=self.hyper.relation_weight), trainable="none",
                   epochs=self.hyper.relation_epochs, context={**relation_context, "features": features},
                   extra=relation_extra(psi, statistics), optimizer="relation")

    def predict(self, cid: int, server: Any, client: dict, features: torch.Tensor) -> torch.Tensor:
        """argmax_{c in K_i} r_{b,c} against the class features of the client's last training.

        Before a client has any class feature (it has not trained with received features yet,
        e.g. after round 1) it predicts with its decision head instead.
        """
        available = client["available"]
        if not bool(available.any()):
            return self.setup.ops_for(cid).head_logits(client["params"], features)
        class_ids = available.nonzero().squeeze(1)
        scores = relation_scores(client["relation"], features, client["class_features"][class_ids],
                                 training=False, buffers=client["relation_stats"])
        return relation_logits(scores, class_ids, self.setup.num_classes)
