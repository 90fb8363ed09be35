"""FedPFA / PFA (Liu, Guo, Chen, *PFA: Privacy-preserving Federated Adaptation for Effective Model
Personalization*, WWW 2021, arXiv:2103.01548); spec: baselines.md "FedPFA". No public code.

Phase 1 (rounds 1..T0, T0 = `switch_round`, default rounds // 2): FedAvg. Its final global model is
the "federated model", kept on the server.
Phase 2 (rounds > T0), federated adaptation:
  * a participant not yet grouped downloads the federated model (message key "federated": the
    key is the request), computes its sparsity vector s_i (for each unit u of the body output,
    the fraction of its training samples whose activation h_u(x) is exactly 0; eval mode, its own
    BatchNorm statistics), trains the federated model as usual and uploads model, n_i and s_i;
  * at the aggregation of the first phase-2 round the server groups the clients that sent s_i into
    G = min(`groups`, #reporters) groups by agglomerative clustering (`linkage`, default average) on
    Euclidean distances; group g's model = n_i-weighted mean of its members' uploads. Clients that
    send s_i later (partial participation) join the group whose mean sparsity vector is nearest [ours];
  * a grouped participant downloads its group model, trains it, uploads it; each group model is
    the n_i-weighted mean of its participating members' uploads (FedAvg inside the group).
Client state: none. Evaluated model: the client's group model; an ungrouped client: the federated
(phase 1: the global) model. Communication: 2 Sigma (+ n_i) per round, plus s_i (#units floats) once.
"""
from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from pfedkit.algorithms.clusters import assignment_vector, cluster_means, one_hot_weights
from pfedkit.algorithms.registry import register
from pfedkit.core.aggregation import fedavg_aggregate
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, HyperParams, Message
from pfedkit.core.errors import ConfigError
from pfedkit.core.params import Params, clone

FEATURE_CHUNK = 512  # samples per eval-mode forward when computing the sparsity vector (memory only)


# ---------------------------------------------------------------------------------------------
# The math (pure functions)


def sparsity_vector(features: torch.Tensor) -> torch.Tensor:
    """s_u = (1/n) sum_x [h_u(x) == 0] over the n rows of `features` [n, ...] (units = the
    flattened remaining axes): the fraction of zero activations of each unit."""
    flat = features.reshape(features.shape[0], -1)
    return (flat == 0).to(torch.float32).mean(0)


def group_clients(vectors: np.ndarray, groups: int, linkage: str = "average") -> np.ndarray:
    """Agglomerative clustering of the rows of `vectors` [m, u] into min(groups, m) groups
    (Euclidean distances, `linkage`), labelled canonically: group 0 holds row 0, the next new
    group the first row not in an earlier group, and so on."""
    vectors = np.asarray(vectors, dtype=np.float64)
    count = min(int(groups), len(vectors))
    if count <= 1:
        return np.zeros(len(vectors), dtype=np.int64)
    from sklearn.cluster import AgglomerativeClustering

    raw = AgglomerativeClustering(n_clusters=count, linkage=linkage, metric="euclidean").fit_predict(vectors)
    relabel: dict[int, int] = {}
    return np.array([relabel.setdefault(int(label), len(relabel)) for label in raw], dtype=np.int64)


def nearest_group(vector: np.ndarray, centroids: np.ndarray) -> int:
    """argmin_g ||vector - centroid_g|| (ties: the lowest g)."""
    distances = np.linalg.norm(np.asarray(centroids, dtype=np.float64) - np.asarray(vector, dtype=np.float64), axis=1)
    return int(np.argmin(distances))


# ---------------------------------------------------------------------------------------------
# The algorithm


@register
class FedPFA(Algorithm):
    name = "fedpfa"
    description = "FedPFA: FedAvg, then FedAvg inside groups of clients with similar activation sparsity"
    evaluated_model = "custom"  # the client's group model, else the federated one
    head = "last"

    class Hyper(HyperParams):
        """FedPFA options (the paper's details are unverified; see docs/algorithms/fedpfa.md).

        switch_round: T0, the last FedAvg round; None = the run's rounds // 2 [ours, spec].
        groups: G, the number of groups (capped at the number of clients that report at the first
            phase-2 round) [ours, spec: 3 for 20 clients, as in DA-PFL's setting].
        linkage: agglomerative linkage on Euclidean distances of sparsity vectors ("average" [ours,
            spec]; "complete", "single" also available).
        """
        switch_round: int | None = Field(None, ge=0, description="T0: last FedAvg round (None: rounds // 2)")
        groups: int = Field(3, ge=1, description="G: number of client groups of phase 2")
        linkage: Literal["average", "complete", "single"] = Field(
            "average", description="agglomerative clustering linkage on the sparsity vectors")

    @property
    def switch_round(self) -> int:
        return self.hyper.switch_round if self.hyper.switch_round is not None else self.setup.rounds // 2

    def check(self) -> None:
        if self.hyper.switch_round is None and self.setup.rounds <= 0:
            raise ConfigError("fedpfa.switch_round: the run's number of rounds is unknown, so set the "
                              "phase switch explicitly (fedpfa.switch_round=T0)")
        if self.hyper.groups > self.setup.num_clients:
            raise ConfigError(f"fedpfa.groups={self.hyper.groups} exceeds the {self.setup.num_clients} clients; "
                              f"use fedpfa.groups <= num_clients")

    # --- state ---------------------------------------------------------------------------------

    def init_server(self, params: Params) -> dict[str, Any]:
        """params: the global model (phase 1), then the federated model (frozen from round T0 on)."""
        return {"params": clone(params), "group_models": [], "assignment": {}, "sparsity": {}}

    # --- round ---------------------------------------------------------------------------------

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        if rnd <= self.switch_round:
            return {cid: {"params": server["params"]} for cid in cids}
        return {cid: ({"params": server["group_models"][server["assignment"][cid]]} if cid in server["assignment"]
                      else {"federated": server["params"]}) for cid in cids}

    def client_update(self, rnd: int, cid: int, client: Any, message: Message, data: ClientData) -> ClientUpdate:
        if "federated" not in message:
            params = yield Fit(message["params"])
            return client, {"params": params, "weight": data.n_train}
        start = message["federated"]
        features = self.setup.ops_for(cid).features(start, data.x_train, data.buffers, chunk=FEATURE_CHUNK)
        sparsity = sparsity_vector(features)
        params = yield Fit(start)
        return client, {"params": params, "weight": data.n_train, "sparsity": sparsity}

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        if not replies:
            return server
        if rnd <= self.switch_round:
            return {**server, "params": fedavg_aggregate(replies)}
        server = self.assign_new(rnd, server, {cid: r["sparsity"] for cid, r in replies.items() if "sparsity" in r})
        ordered = sorted(replies)
        assignment = server["assignment"]
        weights = one_hot_weights([assignment[cid] for cid in ordered], [replies[cid]["weight"] for cid in ordered],
                                  len(server["group_models"]))
        models = cluster_means(server["group_models"], [replies[cid]["params"] for cid in ordered], weights)
        self.record(rnd, "cluster_assignment", assignment_vector(self.setup.num_clients, assignment))
        return {**server, "group_models": models}

    def assign_new(self, rnd: int, server: dict, new: dict[int, torch.Tensor]) -> dict[str, Any]:
        """Group the clients that sent a sparsity vector this round: clustering at the first grouping,
        the nearest group mean (over the current members) afterwards."""
        if not new:
            return server
        ordered = sorted(new)
        vectors = np.stack([new[cid].double().numpy() for cid in ordered])
        assignment, sparsity = dict(server["assignment"]), dict(server["sparsity"])
        models = list(server["group_models"])
        if not assignment:
            labels = group_clients(vectors, self.hyper.groups, self.hyper.linkage)
            models = [server["params"]] * (int(labels.max()) + 1)
            self.record(rnd, "groups", len(models))
        else:
            centroids = np.stack([np.mean([sparsity[c] for c in assignment if assignment[c] == g], axis=0)
                                  for g in range(len(models))])
            labels = [nearest_group(vector, centroids) for vector in vectors]
        assignment.update({cid: int(label) for cid, label in zip(ordered, labels)})
        sparsity.update({cid: vector for cid, vector in zip(ordered, vectors)})
        received = np.full((self.setup.num_clients, vectors.shape[1]), np.nan, dtype=np.float32)
        received[ordered] = vectors
        self.record(rnd, "sparsity", received)
        return {**server, "assignment": assignment, "sparsity": sparsity, "group_models": models}

    def client_model(self, cid: int, server: dict, client: Any) -> Params:
        """The client's group model; ungrouped: the federated (in phase 1 the global) model."""
        group = server["assignment"].get(cid)
        return server["params"] if group is None else server["group_models"][group]
