"""FedReMa (Liang et al., ECAI 2024): classifiers averaged over their most relevant peers.

Spec: shared/specs/seed-algorithms.md §1. Head = all fully connected layers (§1.2).

Each round the body is averaged over the participants as in FedAvg (eq. 6). During the critical
co-learning period (CCP) the server feeds one random probe h ~ U[0,1)^d through every uploaded
head, compares the tempered soft predictions by cosine (relevance matrix S, eq. 5) and, for every
client, cuts its sorted relevance row at the largest jump (MDS, Algorithm 1): the peers above the
cut are averaged into that client's personalised head (eq. 7) and counted in the dependency map
G. The CCP ends for good once the mean largest jump (eq. 8) falls below delta times its peak
(eq. 9); afterwards a client's head is averaged with weights G[i, j] (eq. 10).

Where the state lives. The server computes the personalised heads, so it keeps the latest one
of every client in `server["heads"]` and sends it with the body when the client next takes part;
`client_model` reads it there. A participant's whole model is overwritten by that download, so a
client keeps nothing between rounds (client state None). In the paper the head is downloaded at
the end of round t; here it travels in round t+1's broadcast: the same model is trained and
evaluated, and each participation costs one body + one head downstream either way.

Client variants (§1.7): "F" adds FedPAC's feature alignment to global class prototypes, "A" trains
the head then the body, "AF" both. They need the clients' class prototypes, which are then
uploaded (as is the case for probe="prototypes"); otherwise nothing beyond the model and n_i is.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from pfedkit.algorithms.prototypes import alignment_loss, global_prototypes, present_class_means
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, cross_entropy, Fit, HyperParams, Message
from pfedkit.core.errors import ConfigError
from pfedkit.core.params import Params, clone, merge, select, weighted_mean
from pfedkit.core.seeds import SERVER, torch_generator
from pfedkit.core.search import float_range

PROBE_PURPOSE = "fedrema-probe"
# The code's prototype similarity (sim_type=1) uses a plain softmax (§1.6).
PROTOTYPE_TEMPERATURE = 1.0
# Body outputs of a client's training set are computed in chunks of this many samples.
FEATURE_CHUNK = 1024


# ---------------------------------------------------------------------------------------------
# Server math: relevance, MDS, CCP, aggregation weights


def soft_predictions(logits: torch.Tensor, temperature: float) -> np.ndarray:
    """p = softmax(z / M) (§4.1 of the paper), rows of `logits`, as float64."""
    return torch.softmax(logits.double() / temperature, dim=-1).numpy()


def cosine_relevance(target: np.ndarray, peers: np.ndarray) -> np.ndarray:
    """Eq. 5 for one client: s_j = <p, p_j> / (||p|| ||p_j||) for every row p_j of `peers`.

    Elementwise products then a row sum, so s(a, b) and s(b, a) are computed identically and a
    matrix built row by row from one shared probe is exactly symmetric.
    """
    dots = (peers * target[None, :]).sum(axis=1)
    cosines = dots / (np.linalg.norm(peers, axis=1) * np.linalg.norm(target))
    return np.minimum(cosines, 1.0)  # rounding can exceed 1 by an ulp for equal vectors


def relevance_matrix(soft: np.ndarray) -> np.ndarray:
    """Eq. 5: S_ij = cos(p_i, p_j) over the participants' soft predictions [m, C]; S_ii = 1."""
    matrix = np.stack([cosine_relevance(row, soft) for row in soft])
    np.fill_diagonal(matrix, 1.0)
    return matrix


def mds(relevance: Sequence[float] | np.ndarray, self_index: int,
        rule: Literal["code", "paper"] = "code") -> tuple[list[int], float]:
    """Maximum difference segmentation (Algorithm 1, §1.5): the top group of a relevance vector.

    Sort ascending (ties by position), take the gaps g_m = v_{m+1} - v_m and cut at the first
    largest one; return the positions strictly above the cut plus `self_index`, and that gap.
    rule="code" (default) excludes the topmost gap from the search, so at least one peer joins
    self; rule="paper" searches all gaps and also keeps the element just below the cut (the
    paper's Algorithm 1, off by one against its stated intent). n = 1 gives ([self], 0) and
    n = 2 gives both with gap 0 [ours].
    """
    values = np.asarray(relevance, dtype=np.float64).reshape(-1)
    count = values.size
    if not 0 <= self_index < count:
        raise ValueError(f"mds: self_index {self_index} is outside the relevance vector of length {count}")
    if np.isnan(values).any():
        raise ValueError(f"mds: the relevance vector contains NaN: {values}")
    if rule not in ("code", "paper"):
        raise ValueError(f"mds: rule must be 'code' or 'paper', got {rule!r}")
    if count == 1:
        return [self_index], 0.0
    if count == 2:
        return [0, 1], 0.0
    order = np.argsort(values, kind="stable")
    gaps = np.diff(values[order])
    if rule == "code":
        cut = int(np.argmax(gaps[:-1]))  # argmax returns the first of equal maxima
        chosen = order[cut + 1:]
    else:
        cut = int(np.argmax(gaps))
        chosen = order[cut:]
    # Self is added back in case ties at the top value pushed it below the cut [ours].
    return sorted({int(position) for position in chosen} | {self_index}), float(gaps[cut])


def gap_summary(max_gaps: Sequence[float], how: Literal["mean", "sum"] = "mean") -> float:
    """Eq. 8: the round's average maximum gap Δs̄ = mean_i Δs_i (the paper writes a sum)."""
    gaps = np.asarray(max_gaps, dtype=np.float64)
    return float(gaps.sum() if how == "sum" else gaps.mean())


def ccp_continues(gap_history: Sequence[float], delta: float,
                  boundary: Literal["code", "paper"] = "code") -> bool:
    """Eq. 9: does the critical co-learning period go on after the last recorded round?

    Yes while the last entry of H is the (first) maximum of H. Otherwise the ratio
    H[-1] / max(H) decides: boundary="code" ends the CCP iff ratio < delta, boundary="paper"
    keeps it iff ratio > delta. An all-zero history (2 or fewer participants) keeps it [ours].
    """
    history = np.asarray(gap_history, dtype=np.float64)
    if history.size == 0 or int(np.argmax(history)) == history.size - 1:
        return True
    peak = float(history.max())
    if peak <= 0:
        return True
    ratio = float(history[-1]) / peak
    return ratio >= delta if boundary == "code" else ratio > delta


def dependency_weights(dependency_map: np.ndarray, cid: int, participants: Sequence[int]) -> np.ndarray:
    """Eq. 10 weights of client `cid` over this round's participants: G[cid, j] for j in P_t."""
    return np.asarray(dependency_map[cid, list(participants)], dtype=np.float64)


def draw_probe(seed: int, rnd: int, dim: int, scale: float, purpose: str = PROBE_PURPOSE) -> torch.Tensor:
    """The random feature h ~ U[0, scale)^d, shape [1, d], seeded by (seed, round, SERVER, purpose)."""
    generator = torch_generator(seed, rnd, SERVER, purpose)
    return torch.rand(1, dim, generator=generator) * scale


# ---------------------------------------------------------------------------------------------
# Class prototypes (variants F / A&F and probe="prototypes")


def class_prototypes(features: torch.Tensor, labels: torch.Tensor,
                     num_classes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """c_{i,c} = mean body output over the client's samples of class c, for classes it has.

    Returns (classes [k] int64, prototypes [k, d] float32, counts [k] int64).
    """
    classes, means, counts = present_class_means(features, labels, num_classes)
    return classes, means.float(), counts


# ---------------------------------------------------------------------------------------------
# The algorithm


@register
class FedReMa(Algorithm):
    name = "fedrema"
    description = "FedReMa: FedAvg body, heads averaged over MDS-selected relevant peers (CCP), then by G"
    evaluated_model = "custom"  # global body + the head averaged over the selected peers
    head = "fc"

    class Hyper(HyperParams):
        """FedReMa's options (spec §1.6, §1.7, §1.9). Defaults follow the spec.

        delta: CCP threshold δ of eq. 9.
        temperature: probe temperature M for the target client's soft prediction.
        peer_temperature: temperature for the peers' soft predictions; None = `temperature` for
            every client [paper]; the authors' code uses 1.0.
        probe: "random" = the paper's random feature; "prototypes" = the code's sim_type=1
            (each global class prototype through every head, T = 1, similarities averaged).
        probe_scale: probe entries are U[0, probe_scale): 1.0 [paper]; the code uses 0.5.
        probe_draws: "shared" = one probe per round for all clients [ours]; "per_client" = a
            fresh probe for every target client [code] (S is then not symmetric).
        mds_rule: "code" = clients strictly above the largest non-top gap [code, default];
            "paper" = Algorithm 1 as printed (also keeps the client just below the gap).
        peer_weighting: weights inside A_i (eq. 7): "samples" = n_j [paper]; "uniform" [code].
        gap_summary: eq. 8 as "mean" over participants [ours] or "sum" [paper].
        ccp_boundary: "code" ends the CCP iff ratio < δ; "paper" keeps it iff ratio > δ.
        use_ccp: False runs MDS every round (Table 5's "+MDS (no CCP)" ablation).
        g_fallback: head when Σ_j∈P_t G[i, j] = 0 after the CCP: "own" uploaded head [ours] or
            "participants" = n-weighted mean of all participants' heads.
        similarity_after_ccp: also compute and record S after the CCP (the code does, for logs).
        variant: client training: "none" = CE on the whole model; "F" = + feature alignment;
            "A" = head epochs then body epochs; "AF" = A with alignment in the body phase.
        lambda_f: alignment weight λ_F (F, AF).
        proto_weighting: global prototypes as "uniform" mean over clients [code] or "count"
            weighted by n_{i,c} (FedPAC).
        head_epochs: epochs of the head phase in A/AF; None = local_epochs [code] (FedPAC: 1).
        """
        delta: float = Field(0.5, ge=0, le=1, description="CCP threshold δ (eq. 9)",
                             json_schema_extra=float_range(0.1, 0.9))
        temperature: float = Field(0.5, gt=0, description="probe temperature M",
                                   json_schema_extra=float_range(0.1, 2.0, log=True))
        peer_temperature: float | None = Field(None, gt=0, description="peers' temperature; None = M [paper], code 1.0")
        probe: Literal["random", "prototypes"] = "random"
        probe_scale: float = Field(1.0, gt=0, description="probe ~ U[0, scale): 1.0 paper, 0.5 code")
        probe_draws: Literal["shared", "per_client"] = "shared"
        mds_rule: Literal["code", "paper"] = "code"
        peer_weighting: Literal["samples", "uniform"] = "samples"
        gap_summary: Literal["mean", "sum"] = "mean"
        ccp_boundary: Literal["code", "paper"] = "code"
        use_ccp: bool = True
        g_fallback: Literal["own", "participants"] = "own"
        similarity_after_ccp: bool = False
        variant: Literal["none", "F", "A", "AF"] = "none"
        lambda_f: float = Field(1.0, ge=0, description="feature alignment weight λ_F")
        proto_weighting: Literal["uniform", "count"] = "uniform"
        head_epochs: int | None = Field(None, ge=1, description="A/AF head-phase epochs; None = local_epochs")

    # -- what the options imply ----------------------------------------------------------------

    @property
    def aligns_features(self) -> bool:
        return "F" in self.hyper.variant

    @property
    def alternates(self) -> bool:
        return "A" in self.hyper.variant

    @property
    def uploads_prototypes(self) -> bool:
        return self.aligns_features or self.hyper.probe == "prototypes"

    def check(self) -> None:
        """Refuse options that cannot act on this run's model (one ConfigError line each)."""
        if self.hyper.variant != "none" and not select(self.setup.ops.initial_params(), "body"):
            raise ConfigError(
                f"fedrema.variant={self.hyper.variant}: the model's body has no parameters (FedReMa's head is "
                "every fully connected layer, so the mlp's body is only the flatten), so feature alignment "
                "cannot change a feature and there is no body phase to alternate with; needs a model with "
                "layers before its FC head (model=cnn on mnist, alexnet on cifar10); or set fedrema.variant=none")
        if self.hyper.head_epochs is not None and not self.alternates:
            raise ConfigError(
                f"fedrema.head_epochs={self.hyper.head_epochs}: only the alternating variants A and AF have a "
                f"head phase, but fedrema.variant={self.hyper.variant}; set fedrema.variant=A (or AF) or drop "
                "fedrema.head_epochs")

    # -- state ----------------------------------------------------------------------------------

    def init_server(self, params: Params) -> dict[str, Any]:
        initial = clone(params)
        head = select(initial, "head")
        num_clients = self.setup.num_clients
        return {
            "body": select(initial, "body"),
            "heads": {cid: head for cid in range(num_clients)},  # latest personalised heads
            "dependency_map": np.zeros((num_clients, num_clients), dtype=np.int64),  # G
            "gap_history": [],  # H
            "ccp": True,
            "prototypes": None,  # [C, d] global class prototypes (F / AF / probe="prototypes")
        }

    def client_model(self, cid: int, server: dict, client: Any) -> Params:
        return merge(server["body"], server["heads"][cid])

    # -- client side ----------------------------------------------------------------------------

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        messages = {}
        for cid in cids:
            message = {"body": server["body"], "head": server["heads"][cid]}
            if self.aligns_features and server["prototypes"] is not None:
                message["prototypes"] = server["prototypes"]
            messages[cid] = message
        return messages

    def client_update(self, rnd: int, cid: int, client: Any, message: Message, data: ClientData) -> ClientUpdate:
        params = merge(message["body"], message["head"])
        params = yield from self._local_training(params, message.get("prototypes"))
        reply = {"body": select(params, "body"), "head": select(params, "head"), "weight": data.n_train}
        if self.uploads_prototypes:
            reply.update(self._prototype_upload(params, data))
        return None, reply

    def _local_training(self, params: Params, prototypes: torch.Tensor | None):
        """§1.4 step 2 / §1.7: the round's Fit requests for the chosen variant."""
        context = {"prototypes": prototypes} if self.aligns_features and prototypes is not None else {}
        body_loss = partial(alignment_loss, lambda_f=self.hyper.lambda_f) if self.aligns_features else cross_entropy
        if not self.alternates:
            return (yield Fit(params, loss=body_loss, context=context))
        params = yield Fit(params, trainable="head", epochs=self.hyper.head_epochs)
        return (yield Fit(params, loss=body_loss, trainable="body", context=context))

    def _prototype_upload(self, params: Params, data: ClientData) -> Message:
        """The client's class prototypes, from its body in eval mode with its OWN BatchNorm
        statistics (`data.buffers`, as left by this round's Fit), not the model's initial ones."""
        buffers = data.buffers
        features = self.setup.ops.features(params, data.x_train, buffers, chunk=FEATURE_CHUNK).reshape(data.n_train, -1)
        classes, prototypes, counts = class_prototypes(features, data.y_train, self.setup.num_classes)
        upload = {"prototypes": prototypes, "prototype_classes": classes}
        if self.hyper.proto_weighting == "count":
            upload["prototype_counts"] = counts
        return upload

    # -- server side ----------------------------------------------------------------------------

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        if not replies:
            return server
        participants = sorted(replies)
        sizes = np.array([replies[cid]["weight"] for cid in participants], dtype=np.float64)
        uploaded_heads = [replies[cid]["head"] for cid in participants]
        server = {**server, "heads": dict(server["heads"]),
                  "dependency_map": server["dependency_map"].copy(),
                  "gap_history": list(server["gap_history"])}
        server["body"] = weighted_mean([replies[cid]["body"] for cid in participants], sizes)  # eq. 6
        if self.uploads_prototypes:
            server["prototypes"] = global_prototypes([replies[cid] for cid in participants],
                                                     self.setup.num_classes, self._feature_dim(),
                                                     self.hyper.proto_weighting)
        self.record(rnd, "participants", np.array(participants))
        self.record(rnd, "ccp_active", bool(server["ccp"]))
        if server["ccp"]:
            self._co_learning_round(rnd, server, participants, uploaded_heads, sizes)
        else:
            if self.hyper.similarity_after_ccp:
                self.record(rnd, "relevance", self._relevance(rnd, participants, uploaded_heads,
                                                              server["prototypes"]).astype(np.float32))
            self._dependency_round(server, participants, uploaded_heads, sizes)
        return server

    def _co_learning_round(self, rnd: int, server: dict, participants: list[int],
                           uploaded_heads: list[Params], sizes: np.ndarray) -> None:
        """§1.4 step 5 during the CCP: MDS per client, eq. 7 heads, G counts, eq. 8-9."""
        relevance = self._relevance(rnd, participants, uploaded_heads, server["prototypes"])
        selected, max_gaps = {}, []
        for row, cid in enumerate(participants):
            chosen, gap = mds(relevance[row], row, rule=self.hyper.mds_rule)
            weights = sizes[chosen] if self.hyper.peer_weighting == "samples" else np.ones(len(chosen))
            server["heads"][cid] = weighted_mean([uploaded_heads[j] for j in chosen], weights)  # eq. 7
            peers = [participants[j] for j in chosen]
            server["dependency_map"][cid, peers] += 1
            selected[cid] = np.array(peers)
            max_gaps.append(gap)
        mean_gap = gap_summary(max_gaps, self.hyper.gap_summary)
        server["gap_history"].append(mean_gap)
        if self.hyper.use_ccp and not ccp_continues(server["gap_history"], self.hyper.delta, self.hyper.ccp_boundary):
            server["ccp"] = False  # for good: the next round uses G
            self.record(rnd, "ccp_end", rnd)
        self.record(rnd, "relevance", relevance.astype(np.float32))
        self.record(rnd, "selected", selected)
        self.record(rnd, "max_gaps", np.array(max_gaps))
        self.record(rnd, "mean_max_gap", mean_gap)
        self.record(rnd, "dependency_map", server["dependency_map"].copy())  # G changes only here

    def _dependency_round(self, server: dict, participants: list[int], uploaded_heads: list[Params],
                          sizes: np.ndarray) -> None:
        """§1.4 step 5 after the CCP (eq. 10): head_i = Σ_j G[i,j] head_j / Σ_j G[i,j] over P_t."""
        for row, cid in enumerate(participants):
            weights = dependency_weights(server["dependency_map"], cid, participants)
            if weights.sum() > 0:
                used = np.flatnonzero(weights)
                server["heads"][cid] = weighted_mean([uploaded_heads[j] for j in used], weights[used])
            elif self.hyper.g_fallback == "own":
                server["heads"][cid] = uploaded_heads[row]
            else:
                server["heads"][cid] = weighted_mean(uploaded_heads, sizes)

    def _feature_dim(self) -> int:
        return int(self.setup.ops.template.feature_dim)

    def _relevance(self, rnd: int, participants: list[int], heads: list[Params],
                   prototypes: torch.Tensor | None) -> np.ndarray:
        """The relevance matrix S over the participants (rows: target client), eq. 5."""
        ops = self.setup.ops
        if self.hyper.probe == "prototypes":
            known = prototypes[~torch.isnan(prototypes).any(dim=1)]
            logits = torch.stack([ops.head_logits(head, known) for head in heads], dim=1)  # [k, m, C]
            return np.mean([relevance_matrix(soft_predictions(per_class, PROTOTYPE_TEMPERATURE))
                            for per_class in logits], axis=0)
        peer_temperature = self.hyper.temperature if self.hyper.peer_temperature is None else self.hyper.peer_temperature
        shared = self.hyper.probe_draws == "shared"
        matrix = np.empty((len(heads), len(heads)))
        logits = self._probe_logits(rnd, heads, PROBE_PURPOSE) if shared else None
        for row, cid in enumerate(participants):
            if not shared:  # the code redraws the probe for every target client
                logits = self._probe_logits(rnd, heads, f"{PROBE_PURPOSE}-{cid}")
            target = soft_predictions(logits[row], self.hyper.temperature)
            matrix[row] = cosine_relevance(target, soft_predictions(logits, peer_temperature))
        np.fill_diagonal(matrix, 1.0)
        return matrix

    def _probe_logits(self, rnd: int, heads: list[Params], purpose: str) -> torch.Tensor:
        """g_φ(h̃) of every head on the round's probe, [m, C] (template in eval mode, no grad)."""
        probe = draw_probe(self.setup.seed, rnd, self._feature_dim(), self.hyper.probe_scale, purpose)
        return torch.cat([self.setup.ops.head_logits(head, probe) for head in heads])
