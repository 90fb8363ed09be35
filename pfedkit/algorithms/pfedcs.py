"""PFedCS (Wu et al., AAAI 2025): collaboration among clients with similar classifiers.

Spec: shared/specs/seed-algorithms.md §4. The paper writes K clients and C^t participants; here N
and P_t. Head = the last Linear layer (weight phi_k [C, d] and bias), body = the rest.

Stage 1 (rounds t <= beta):
  * the server measures row-normalised squared distances between the participants' classifiers
    (eq. 3), splits each client's distances into near/far with a 2-component 1-D GMM (candidates),
    keeps the candidates under a threshold sliding from the mean (t = 0) to the minimum (t = beta)
    distance (eq. 4-5) and averages its own and its collaborators' classifiers with the
    distance-constrained weights of eq. 7-8 into a customised classifier v_k (eq. 6);
  * the client replaces its body with the global (FedAvg) body, fine-tunes v_k for rho epochs with
    the body frozen (eq. 9-10), then trains its body and own head with CE + KL(p^v || p^w) where
    the fine-tuned v_k is a frozen teacher (eq. 11-13). v_k is then discarded.
Stage 2 (t > beta): FedPer (bodies up and down, heads stay on the clients).

How the paper's round maps onto the engine's hooks. The paper's round t starts with P_t uploading
their current models; the server then builds v_k and the body; the clients download and train.
In the engine a client uploads right after its training, so:
  * the customised classifiers of round t are computed in `broadcast(t)` from each participant's
    latest uploaded head. A client's head only changes when it trains, and it uploads after every
    training, so this IS its current head, as the paper has it, also under partial participation
    (a client that never uploaded still holds the shared initial head, which the server knows).
    Round 1 therefore works on identical initial heads (all distances 0, v_k = the initial head),
    as in the paper, where round 1 uploads "are all the initial model".
  * the body is FedAvg of the bodies uploaded at the end of the previous round (`aggregate`), the
    FedPer/PFLlib order; with full participation (the paper's setting) it is the paper's theta^t.
  * a head travels up only when a later round still needs it: after training in round t the
    client uploads its head iff t + 1 is a stage-1 round. Uploads of every round whose
    aggregation is stage 2 (the paper's t > beta) carry the body and n_k only.

Messages (spec §4.8): stage 1 down = {"body", "head" (= v_k)}, up = {"body", "head", "weight" = n_k}
(the head is left out of the last stage-1 upload, see above); stage 2 down = {"body"}, up =
{"body", "weight"}.

Server state: {"body", "heads": {cid: latest uploaded head}, "counts": {cid: latest n_k},
"initial_head"}; everything but the body is dropped once stage 1 is over.
Client state: {"head": phi_k} (its body is replaced by the global body at every download).
Evaluated model (spec §4.6): global body + own head, i.e. right after the next download.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, PositiveFloat, PositiveInt

from pfedkit.algorithms.evaluated_head import HeadFromEvaluatedModel
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, Forward, HyperParams, Message
from pfedkit.core.errors import ConfigError
from pfedkit.core.params import Params, clone, linear_layer_names, merge, select, weighted_mean
from pfedkit.core.seeds import derive_seed
from pfedkit.core.search import float_range, int_range

GROUPINGS = ("gmm", "kmeans", "agglomerative", "fixed")
NORMALISATIONS = ("l2", "none")
TEACHERS = ("frozen", "current_features")


# ---------------------------------------------------------------------------------------------
# The math (pure functions)
# ---------------------------------------------------------------------------------------------

def classifier_distances(classifiers: torch.Tensor | np.ndarray) -> np.ndarray:
    """Numerator of eq. 3: raw D_ij = ||phi_i - phi_j||_2^2 between flattened classifiers [m, p].

    Computed row by row from the differences in float64, so D is exactly symmetric with an exact
    zero diagonal (the Gram-matrix shortcut is not).
    """
    vectors = torch.as_tensor(classifiers).detach().to(torch.float64)
    if vectors.dim() != 2:
        raise ValueError(f"classifier_distances expects one flattened classifier per row [m, p], "
                         f"got shape {tuple(vectors.shape)}")
    rows = [((vectors - vectors[i]) ** 2).sum(dim=1) for i in range(vectors.shape[0])]
    if not rows:
        return np.zeros((0, 0))
    return torch.stack(rows).numpy()


def row_normalise(distances: np.ndarray) -> np.ndarray:
    """Eq. 3: D_ij / max_j D_ij, row by row. A row whose maximum is 0 stays all-zero [ours].

    The result is in [0, 1], each non-zero row has maximum exactly 1, and it is generally not
    symmetric.
    """
    distances = np.asarray(distances, dtype=np.float64)
    row_max = distances.max(axis=1, keepdims=True) if distances.size else np.zeros((distances.shape[0], 1))
    return np.divide(distances, row_max, out=np.zeros_like(distances), where=row_max > 0)


def distance_threshold(distances: np.ndarray, t: int, beta: int) -> float:
    """Eq. 4: tau_{t,k} = avg(D_k) + (t / beta) (min(D_k) - avg(D_k)).

    Written as (1 - s) avg + s min with s = t / beta, the same affine function of t, so that the
    end points are exact: the mean at t = 0 and the minimum at t = beta (a collaborator at exactly
    the minimum distance must pass eq. 5 at t = beta).
    """
    values = np.asarray(distances, dtype=np.float64).reshape(-1)
    if values.size == 0:
        raise ValueError("distance_threshold needs at least one distance (a client with no other participant)")
    if beta <= 0:
        raise ValueError(f"distance_threshold: beta must be a positive number of rounds, got {beta}")
    share = t / beta
    return float((1.0 - share) * values.mean() + share * values.min())


def candidate_mask(distances: np.ndarray, *, grouping: str = "gmm", seed: int = 0,
                   fixed_threshold: float = 0.5, reg_covar: float = 1e-6, max_iter: int = 100,
                   n_init: int = 1) -> np.ndarray:
    """Candidates Cand_k among the other participants, from k's distances D_k (spec §4.4 step 4.2).

    "gmm" (paper): a 2-component 1-D Gaussian mixture; the entries whose maximum-posterior
    component is the one with the lower mean. "kmeans" / "agglomerative" (Table 4): the cluster
    with the lower mean distance. "fixed" (Table 4): D_kj <= fixed_threshold. For the clustering
    groupings, fewer than 2 entries or fewer than 2 distinct values make every entry a candidate
    [ours]. `seed` seeds the clustering (never global randomness).
    """
    values = np.asarray(distances, dtype=np.float64).reshape(-1)
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping must be one of {', '.join(GROUPINGS)}, got {grouping!r}")
    if grouping == "fixed":
        return values <= fixed_threshold
    if values.size < 2 or np.unique(values).size < 2:
        return np.ones(values.size, dtype=bool)
    column = values.reshape(-1, 1)
    seed = int(seed) % 2**32  # sklearn's RandomState takes 32-bit seeds
    with warnings.catch_warnings():
        from sklearn.exceptions import ConvergenceWarning
        warnings.simplefilter("ignore", ConvergenceWarning)  # tight 1-D clusters; the labels are fine
        if grouping == "gmm":
            from sklearn.mixture import GaussianMixture
            mixture = GaussianMixture(n_components=2, covariance_type="full", reg_covar=reg_covar,
                                      max_iter=max_iter, n_init=n_init, random_state=seed).fit(column)
            labels, near = mixture.predict(column), int(np.argmin(mixture.means_.reshape(-1)))
        elif grouping == "kmeans":
            from sklearn.cluster import KMeans
            kmeans = KMeans(n_clusters=2, n_init=n_init, random_state=seed).fit(column)
            labels, near = kmeans.labels_, int(np.argmin(kmeans.cluster_centers_.reshape(-1)))
        else:
            from sklearn.cluster import AgglomerativeClustering
            labels = AgglomerativeClustering(n_clusters=2).fit_predict(column)
            near = int(np.argmin([values[labels == g].mean() for g in (0, 1)]))
    return labels == near


def select_collaborators(distances: np.ndarray, candidates: np.ndarray, threshold: float) -> np.ndarray:
    """Eq. 5: Col_k = {i in Cand_k : D_ki <= tau_{t,k}} (a mask over k's distances)."""
    return np.asarray(candidates, dtype=bool) & (np.asarray(distances, dtype=np.float64) <= threshold)


def dca_terms(collaborator_distances: np.ndarray, collaborator_counts: np.ndarray,
              own_count: float) -> tuple[np.ndarray, np.ndarray]:
    """The two terms of eq. 7 for [collaborators..., k] (D_kk = 0), before mixing by lambda.

    similarity_i = (D_max - D_ki) / (|Col| (D_max - D_avg)), data_i = n_i / sum_{j in Col} n_j,
    with D_max, D_avg over Col (eq. 8). Over Col alone each term sums to 1. When
    D_max - D_avg = 0 the fraction (D_max - D_ki) / (D_max - D_avg) is 1 for every i [ours]; when
    the collaborators hold no samples the data term is 1/|Col| [ours].
    """
    distances = np.asarray(collaborator_distances, dtype=np.float64).reshape(-1)
    counts = np.asarray(collaborator_counts, dtype=np.float64).reshape(-1)
    if distances.size == 0 or distances.size != counts.size:
        raise ValueError(f"dca_terms needs one count per collaborator and at least one collaborator, got "
                         f"{distances.size} distances and {counts.size} counts")
    size = distances.size
    with_own = np.append(distances, 0.0)
    spread = distances.max() - distances.mean()
    fraction = (distances.max() - with_own) / spread if spread > 0 else np.ones(size + 1)
    similarity = fraction / size
    total = counts.sum()
    data = np.append(counts, own_count) / total if total > 0 else np.full(size + 1, 1.0 / size)
    return similarity, data


def dca_weights(collaborator_distances: np.ndarray, collaborator_counts: np.ndarray, own_count: float,
                lam: float, renormalise: bool = True) -> np.ndarray:
    """Eq. 7: p_i = lam * similarity_i + (1 - lam) * data_i for [collaborators..., k].

    With k added the weights sum to more than 1; `renormalise` divides them by their sum [ours]
    (False keeps eq. 6 literally, which scales v_k up).
    """
    similarity, data = dca_terms(collaborator_distances, collaborator_counts, own_count)
    weights = lam * similarity + (1.0 - lam) * data
    return weights / weights.sum() if renormalise else weights


@dataclass(frozen=True)
class Collaboration:
    """What the server decided for one client k in one stage-1 round (indices into P_t)."""
    candidates: list[int]
    collaborators: list[int]
    threshold: float
    weights: np.ndarray  # DCA weights of [collaborators..., k]; [1.0] when Col_k is empty


def plan_collaboration(normalised: np.ndarray, counts: Sequence[float], k: int, t: int, beta: int, *,
                       lam: float, renormalise: bool = True, grouping: str = "gmm", seed: int = 0,
                       fixed_threshold: float = 0.5, reg_covar: float = 1e-6, max_iter: int = 100,
                       n_init: int = 1) -> Collaboration:
    """Steps 4.1-4.5 of spec §4.4 for the participant at row k of the normalised distances.

    counts[j] = n_j of the participant at row j. Returns candidates, collaborators (eq. 5), the
    threshold (eq. 4) and the DCA weights (eq. 7-8).
    """
    others = [j for j in range(normalised.shape[0]) if j != k]
    if not others:
        return Collaboration([], [], float("nan"), np.ones(1))
    to_others = normalised[k, others]
    candidates = candidate_mask(to_others, grouping=grouping, seed=seed, fixed_threshold=fixed_threshold,
                                reg_covar=reg_covar, max_iter=max_iter, n_init=n_init)
    threshold = distance_threshold(to_others, t, beta)
    chosen = select_collaborators(to_others, candidates, threshold)
    collaborators = [others[i] for i in np.flatnonzero(chosen)]
    weights = (dca_weights(normalised[k, collaborators], [counts[j] for j in collaborators], counts[k],
                           lam, renormalise) if collaborators else np.ones(1))
    return Collaboration([others[i] for i in np.flatnonzero(candidates)], collaborators, threshold, weights)


def normalise_logits(logits: torch.Tensor, kind: str) -> torch.Tensor:
    """The paper's classifier g is "a linear transformation with weight phi_k and bias, followed by
    *Normalization* and *Softmax*" (section "Adaptive Collaborator Selection Mechanism"); the paper
    names no kind of normalisation and gives no formula.

    "l2" [ours: the kind]: each sample's logit vector divided by its L2 norm, z / max(||z||_2, 1e-12)
    (F.normalize over the classes), so p = softmax(z / ||z||). A positive per-sample scale, so the
    predicted class (argmax) is the head's own; the probabilities, the losses and their gradients
    are not. "none": p = softmax(z), a plain Linear classifier.
    """
    if kind == "l2":
        return F.normalize(logits, p=2.0, dim=-1)
    if kind == "none":
        return logits
    raise ValueError(f"logit normalisation must be one of {', '.join(NORMALISATIONS)}, got {kind!r}")


def classifier_loss(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any], *,
                    normalisation: str = "l2") -> torch.Tensor:
    """L_CE(p, y) with p = softmax(norm(z)), mean over the batch: eq. 9-10 (fine-tuning the
    customised classifier) and stage 2's FedPer training."""
    return F.cross_entropy(normalise_logits(out.logits, normalisation), y)


def teacher_logits(out: Forward, context: Mapping[str, Any]) -> torch.Tensor:
    """The teacher's raw logits for the batch, as the Fit context defines the teacher.

    context["teacher_logits"] [n, C] (teacher="frozen"): eq. 10's g(f(x; theta^t); v_bar), the
    fine-tuned customised classifier on the downloaded body, computed once per Fit for every
    training sample; the batch's rows are out.index. context["teacher_weight"] / ["teacher_bias"]
    (teacher="current_features" [ours]): v_bar applied to the CURRENT (trainable) features, detached.
    """
    if "teacher_logits" in context:
        if out.index is None:
            raise ValueError("kl_guided_loss with a frozen teacher needs Forward.index (the batch's rows)")
        return context["teacher_logits"][out.index]
    features = out.features.detach()
    weight = context["teacher_weight"].to(features.dtype)
    bias = context.get("teacher_bias")
    return F.linear(features, weight, None if bias is None else bias.to(features.dtype))


def kl_guided_loss(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any], *,
                   normalisation: str = "l2") -> torch.Tensor:
    """Eq. 12-13: L_EN = CE(p^w, y) + KL(p^v || p^w), temperature 1, KL averaged over the batch.

    p^w = softmax(norm(z)) of the local classifier, p^v = softmax(norm(z_v)) of the teacher
    (`teacher_logits`), computed without gradient: neither v_bar nor the body learns through it.
    """
    with torch.no_grad():
        teacher = normalise_logits(teacher_logits(out, context).to(out.logits.dtype), normalisation)
        teacher_log_probs = F.log_softmax(teacher, dim=1)
    student = normalise_logits(out.logits, normalisation)
    kl = F.kl_div(F.log_softmax(student, dim=1), teacher_log_probs, reduction="batchmean", log_target=True)
    return F.cross_entropy(student, y) + kl


def current_feature_teacher(head: Params) -> dict[str, torch.Tensor]:
    """Fit context of teacher="current_features": the fine-tuned customised classifier, detached."""
    weight_name, bias_name = linear_layer_names(head, "head")
    context = {"teacher_weight": head[weight_name].detach()}
    if bias_name is not None:
        context["teacher_bias"] = head[bias_name].detach()
    return context


@torch.no_grad()
def frozen_teacher_outputs(ops: Any, teacher: Params, x: torch.Tensor, buffers: Params | None,
                           rows: int, num_classes: int, chunk: int = 1000) -> torch.Tensor:
    """Fit context of teacher="frozen": eq. 10's teacher logits g(f(x; theta^t); v_bar) for every
    training sample, [rows, C] float32, row i = sample i; rows past len(x) are zero padding.

    The model runs in eval mode with the client's current buffers (BatchNorm: running statistics;
    dropout: off). Padding every client to the same `rows` gives all clients' contexts one shape,
    so the vectorized runtime trains them as one group.
    """
    outputs = torch.zeros(max(rows, len(x)), num_classes)
    if len(x):
        outputs[:len(x)] = ops.logits(teacher, x, buffers, chunk=chunk).float()
    return outputs


# ---------------------------------------------------------------------------------------------
# The algorithm
# ---------------------------------------------------------------------------------------------

@register
class PFedCS(HeadFromEvaluatedModel, Algorithm):
    name = "pfedcs"
    description = "PFedCS: GMM-chosen similar classifiers -> customised teacher head, then FedPer"
    evaluated_model = "custom"  # global body + own head, with normalised logits
    head = "last"

    class Hyper(HyperParams):
        """PFedCS hyperparameters (spec §4.7; [ours] choices of §4.4-4.5 as options).

        beta: number of stage-1 rounds (paper: not stated; spec default 100 = T/2). 0 = FedPer.
        dca_lambda: lambda of eq. 7, similarity vs data-size weighting (paper: not stated; 0.5).
        rho: epochs fine-tuning the customised classifier, body frozen (paper Table 5: 1). 0 uses
            the customised classifier as the teacher without fine-tuning.
        finetune_lr: eta_v; None = the run's lr (eta_w), as in the paper.
        grouping: how candidates are found: "gmm" (paper), "kmeans", "agglomerative", or "fixed"
            (distance <= fixed_threshold) (Table 4).
        fixed_threshold: the threshold of grouping="fixed" (paper: 0.5).
        gmm_reg_covar, gmm_max_iter, gmm_n_init: GaussianMixture settings [ours]; n_init is also
            used by kmeans.
        distance_includes_bias: measure distances over weight and bias (False: weight only [ours]).
        dca_renormalise: divide the eq. 7 weights over Col_k + {k} by their sum [ours]; False keeps
            eq. 6 literally (weights sum to more than 1).
        stage_one_includes_beta: stage 1 is t <= beta [ours, so eq. 4 reaches its minimum end
            point]; False: t < beta (the paper's "FedPer when t >= beta").
        teacher: where p^v of eq. 12 comes from. "frozen" (paper, eq. 10): the fine-tuned customised
            classifier on the downloaded body theta^t, which local training does not change; its
            logits are computed once per round for every training sample (eval mode: BatchNorm
            running statistics, no dropout). "current_features" [ours, the earlier default]: the
            fine-tuned classifier on the features of the body being trained, detached.
        logit_normalisation: the "Normalization" between the classifier's Linear layer and its
            Softmax (paper, section "Adaptive Collaborator Selection Mechanism"; the kind is not
            stated): "l2" [ours: the kind] divides each logit vector by its L2 norm, in every loss
            (fine-tuning, KL-guided training, stage 2) and in prediction; "none": a plain Linear
            classifier (stage 2 then equals FedPer exactly).
        """
        beta: int = Field(100, ge=0, description="stage-1 rounds (then FedPer)")
        dca_lambda: float = Field(0.5, ge=0, le=1, description="DCA balance lambda (eq. 7)",
                                  json_schema_extra=float_range(0.1, 0.9))
        rho: int = Field(1, ge=0, description="fine-tuning epochs of the customised classifier",
                         json_schema_extra=int_range(1, 5))
        finetune_lr: PositiveFloat | None = Field(None, description="eta_v; None = the run's lr")
        grouping: Literal["gmm", "kmeans", "agglomerative", "fixed"] = Field("gmm", description="candidate grouping")
        fixed_threshold: float = Field(0.5, ge=0, description="threshold of grouping='fixed'")
        gmm_reg_covar: PositiveFloat = Field(1e-6, description="GaussianMixture reg_covar")
        gmm_max_iter: PositiveInt = Field(100, description="GaussianMixture max_iter")
        gmm_n_init: PositiveInt = Field(1, description="GaussianMixture / KMeans n_init")
        distance_includes_bias: bool = Field(False, description="classifier distance over weight and bias")
        dca_renormalise: bool = Field(True, description="renormalise the eq. 7 weights to sum 1")
        stage_one_includes_beta: bool = Field(True, description="stage 1 is t <= beta (False: t < beta)")
        teacher: Literal["frozen", "current_features"] = Field(
            "frozen", description="KL teacher: v_bar on the downloaded body (paper) or on the current features")
        logit_normalisation: Literal["l2", "none"] = Field(
            "l2", description="normalisation of the classifier output before softmax (paper: 'Normalization')")

    # -- stages ---------------------------------------------------------------------------------

    def in_stage_one(self, rnd: int) -> bool:
        return rnd <= self.hyper.beta if self.hyper.stage_one_includes_beta else rnd < self.hyper.beta

    # -- hooks ----------------------------------------------------------------------------------

    def check(self) -> None:
        """One ConfigError line for options that do not fit the run's model or clients."""
        head = select(self.setup.ops.initial_params(), "head")
        try:
            _, bias_name = linear_layer_names(head, "head")
        except ValueError:
            raise ConfigError(f"model: pfedcs needs the head (the model's last layer) to be one Linear layer, got "
                              f"head parameters {sorted(head)}; allowed: a model ending in a Linear layer (mlp, cnn, "
                              f"resnet18, ...); choose such a model") from None
        if self.hyper.distance_includes_bias and bias_name is None:
            raise ConfigError("pfedcs.distance_includes_bias: true, but the model's classifier has no bias; the "
                              "distance can only use the weight; set pfedcs.distance_includes_bias=false")
        if self.in_stage_one(1) and self.setup.num_clients < 2:
            raise ConfigError(f"pfedcs.beta: stage 1 ({self.hyper.beta} rounds) picks collaborators among clients but "
                              f"the run has {self.setup.num_clients} client; needs num_clients >= 2; set "
                              "num_clients >= 2 or pfedcs.beta=0 (FedPer)")

    def init_server(self, params: Params) -> dict[str, Any]:
        server = {"body": clone(select(params, "body"))}
        if self.in_stage_one(1):
            server.update(heads={}, counts={}, initial_head=clone(select(params, "head")))
        return server

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        return {"head": clone(select(params, "head"))}

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        if not self.in_stage_one(rnd):
            return {cid: {"body": server["body"]} for cid in cids}
        customised = self.customised_classifiers(rnd, server, cids)
        return {cid: {"body": server["body"], "head": customised[cid]} for cid in cids}

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        body, ce_loss = message["body"], partial(classifier_loss, normalisation=self.hyper.logit_normalisation)
        if self.in_stage_one(rnd):
            teacher = merge(body, message["head"])
            if self.hyper.rho > 0:  # eq. 9-10: fine-tune v_k on local data, body frozen
                tuned = yield Fit(teacher, loss=ce_loss, trainable="head", epochs=self.hyper.rho, lr=self.hyper.finetune_lr)
                teacher = merge(body, select(tuned, "head"))
            # eq. 11-13: body + own head, guided by the frozen fine-tuned teacher (then discarded)
            params = yield Fit(merge(body, client["head"]), context=self.teacher_context(cid, teacher, data),
                               loss=partial(kl_guided_loss, normalisation=self.hyper.logit_normalisation))
        else:  # stage 2: FedPer
            params = yield Fit(merge(body, client["head"]), loss=ce_loss)
        head = select(params, "head")
        reply: Message = {"body": select(params, "body"), "weight": data.n_train}
        if self.in_stage_one(rnd + 1):  # the next round's server still compares classifiers
            reply["head"] = head
        return {"head": head}, reply

    def teacher_context(self, cid: int, teacher: Params, data: ClientData) -> dict[str, torch.Tensor]:
        """The KL-guided Fit's context for `teacher` = downloaded body + fine-tuned v_bar (eq. 10-12).

        "frozen": the teacher's logits for every training sample, padded to the largest client's
        training set size (one shape for every client, so they train as one vectorized group)."""
        if self.hyper.teacher == "current_features":
            return current_feature_teacher(select(teacher, "head"))
        rows = int(np.asarray(self.setup.train_counts).sum(axis=1).max())
        return {"teacher_logits": frozen_teacher_outputs(self.setup.ops_for(cid), teacher, data.x_train,
                                                         data.buffers, rows, self.setup.num_classes)}

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        contributors = sorted(c for c in replies if replies[c]["weight"] > 0)
        body = (weighted_mean([replies[c]["body"] for c in contributors],
                              [replies[c]["weight"] for c in contributors])
                if contributors else server["body"])
        if not self.in_stage_one(rnd + 1):
            return {"body": body}  # stage 1 is over: the server no longer needs classifiers
        heads, counts = dict(server["heads"]), dict(server["counts"])
        for cid, reply in replies.items():
            counts[cid] = reply["weight"]
            if "head" in reply:
                heads[cid] = reply["head"]
        return {"body": body, "heads": heads, "counts": counts, "initial_head": server["initial_head"]}

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        return merge(server["body"], client["head"])

    def has_custom_predict(self) -> bool:
        return self.hyper.logit_normalisation != "none"

    def predict(self, cid: int, server: dict, client: dict, features: torch.Tensor) -> torch.Tensor:
        """The paper's classifier: the client's head, then the normalisation (same argmax as the
        head alone; the evaluation loss is that of the normalised probabilities)."""
        logits = self.setup.ops_for(cid).head_logits(client["head"], features)
        return normalise_logits(logits, self.hyper.logit_normalisation)

    # -- stage-1 server math --------------------------------------------------------------------

    def customised_classifiers(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Params]:
        """Eq. 3-8 for the round's participants: v_k for each, recorded for the report."""
        if not cids:  # a round nobody joined (participants=poisson)
            return {}
        cids = sorted(cids)
        heads = [server["heads"].get(cid, server["initial_head"]) for cid in cids]
        counts = self.known_counts(server["counts"], cids)
        normalised = row_normalise(classifier_distances(torch.stack([self.classifier_vector(h) for h in heads])))
        customised, plans = {}, {}
        for k, cid in enumerate(cids):
            plan = plan_collaboration(
                normalised, counts, k, rnd, self.hyper.beta, lam=self.hyper.dca_lambda,
                renormalise=self.hyper.dca_renormalise, grouping=self.hyper.grouping,
                seed=derive_seed(self.setup.seed, rnd, cid, "pfedcs-grouping"),
                fixed_threshold=self.hyper.fixed_threshold, reg_covar=self.hyper.gmm_reg_covar,
                max_iter=self.hyper.gmm_max_iter, n_init=self.hyper.gmm_n_init)
            members = [heads[j] for j in plan.collaborators] + [heads[k]]
            customised[cid] = weighted_sum(members, plan.weights)
            plans[cid] = plan
        self.record_round(rnd, cids, normalised, plans)
        return customised

    def classifier_vector(self, head: Params) -> torch.Tensor:
        """phi_k flattened: the weight matrix, plus the bias with distance_includes_bias."""
        weight_name, bias_name = linear_layer_names(head, "head")
        parts = [head[weight_name].reshape(-1)]
        if self.hyper.distance_includes_bias and bias_name is not None:
            parts.append(head[bias_name].reshape(-1))
        return torch.cat(parts).detach().to(torch.float64)

    @staticmethod
    def known_counts(counts: Mapping[int, float], cids: list[int]) -> list[float]:
        """n_k as last uploaded; a client that never uploaded counts as the mean of the known ones
        (1 if none is known) [ours]: the paper's clients upload n_k before round 1's aggregation,
        ours first do so after their first training (round 1 heads are identical, so it only
        matters for late joiners under partial participation)."""
        known = [float(counts[c]) for c in cids if c in counts]
        fallback = float(np.mean(known)) if known else 1.0
        return [float(counts[c]) if c in counts else fallback for c in cids]

    # -- diagnostics ----------------------------------------------------------------------------

    def record_round(self, rnd: int, cids: list[int], normalised: np.ndarray, plans: dict[int, Collaboration]) -> None:
        """Per stage-1 round: the normalised distance matrix (NaN outside P_t), each client's
        candidates and collaborators (row k, 0/1), and its threshold tau_{t,k}. Called from
        `broadcast`, where this implementation makes the round's decisions (see the module notes)."""
        n = self.setup.num_clients
        distance = np.full((n, n), np.nan)
        distance[np.ix_(cids, cids)] = normalised
        candidates = np.zeros((n, n), dtype=np.int8)
        collaborators = np.zeros((n, n), dtype=np.int8)
        threshold = np.full(n, np.nan)
        for cid, plan in plans.items():
            candidates[cid, [cids[j] for j in plan.candidates]] = 1
            collaborators[cid, [cids[j] for j in plan.collaborators]] = 1
            threshold[cid] = plan.threshold
        self.record(rnd, "distance", distance)
        self.record(rnd, "candidates", candidates)
        self.record(rnd, "collaborators", collaborators)
        self.record(rnd, "threshold", threshold)


def weighted_sum(params_list: Sequence[Params], weights: np.ndarray) -> Params:
    """Eq. 6: v_k = sum_i p_i phi_i (weights used as given, so an unnormalised eq. 7 stays so)."""
    weights = [float(w) for w in weights]
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"DCA weights must have a positive sum, got {weights}")
    # weighted_mean divides by the sum; scaling back keeps eq. 6 literal when weights do not sum to 1
    mean = weighted_mean(params_list, weights)
    return mean if abs(total - 1.0) < 1e-12 else {name: value * total for name, value in mean.items()}
