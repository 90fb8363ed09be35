"""CFL (Sattler, Müller, Samek, IEEE TNNLS 32(8), 2021): clustered FL by recursive bi-partitioning
of the clients whose updates disagree.

Spec: baselines.md "CFL". All clients start in one cluster whose model is the initial model.
Round t:

* each participant downloads its cluster's model w_c, trains it E epochs and uploads the result
  w_i with n_i; the server forms the update Delta_i = w_i - w_c;
* per cluster c with participants P_c: mean_norm = ||sum_i a_i Delta_i|| (a_i = n_i / sum n_j,
  or 1/|P_c| with `update_weighting="uniform"`), max_norm = max_i ||Delta_i||;
* if t >= warmup, |P_c| > min_cluster_size, mean_norm < eps1 and max_norm > eps2 (the cluster sits
  at a stationary point of the joint objective while single clients still move), P_c is split in
  two by complete-linkage agglomerative clustering on the distance 1 - cos(Delta_i, Delta_j); the
  part holding the lowest client id keeps the cluster's index and its members that did not take
  part this round [ours], the other part becomes a new cluster starting from w_c;
* every cluster model moves by the weighted mean update of its participating members:
  w_c + sum_i a_i Delta_i = sum_i a_i w_i (computed as the latter, `clusters.cluster_means`, so
  without splits CFL is FedAvg to the last bit); clusters without participants keep their model.

Client state: none (its cluster lives on the server). Evaluated: the client's cluster model.
Communication: one model down, one model + n_i up.
"""
from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import Field
from scipy.cluster.hierarchy import linkage, to_tree
from scipy.spatial.distance import squareform

from pfedkit.algorithms import clusters
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, HyperParams, Message
from pfedkit.core.params import Params, clone

_COSINE_EPS = 1e-12  # norms below this count as zero updates (cosine 0 with everything)


def update_gram(base: Params, uploads: list[Params]) -> np.ndarray:
    """G[i, j] = <Delta_i, Delta_j>, Delta_i = uploads[i] - base over all entries, in float64
    (accumulated layer by layer, so no [m, Sigma] matrix is held)."""
    gram = np.zeros((len(uploads), len(uploads)))
    for name, centre in base.items():
        deltas = np.stack([(upload[name].double() - centre.double()).reshape(-1).numpy() for upload in uploads])
        gram += deltas @ deltas.T
    return gram


def update_norms(gram: np.ndarray, weights: np.ndarray) -> tuple[float, float]:
    """(mean_norm, max_norm) = (||sum_i a_i Delta_i||, max_i ||Delta_i||), a = weights / sum(weights),
    from the Gram matrix: ||sum_i a_i Delta_i||^2 = a^T G a."""
    shares = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    mean_sq = float(shares @ gram @ shares)
    return float(np.sqrt(max(mean_sq, 0.0))), float(np.sqrt(max(float(np.max(np.diag(gram))), 0.0)))


def should_split(mean_norm: float, max_norm: float, participants: int, rnd: int, *, eps1: float, eps2: float,
                 warmup: int, min_cluster_size: int) -> bool:
    """Sattler's criterion: t >= warmup, |P_c| > min_cluster_size, mean_norm < eps1, max_norm > eps2."""
    return rnd >= warmup and participants > min_cluster_size and mean_norm < eps1 and max_norm > eps2


def cosine_distances(gram: np.ndarray) -> np.ndarray:
    """D[i, j] = 1 - cos(Delta_i, Delta_j) = 1 - G_ij / (||Delta_i|| ||Delta_j||), in [0, 2]; a zero
    update has cosine 0 with every other one; D[i, i] = 0."""
    norms = np.sqrt(np.clip(np.diag(gram), 0.0, None))
    safe = np.where(norms > _COSINE_EPS, norms, np.inf)
    cosine = np.clip(gram / np.outer(safe, safe), -1.0, 1.0)
    distances = 1.0 - cosine
    np.fill_diagonal(distances, 0.0)
    return (distances + distances.T) / 2


def bipartition(gram: np.ndarray) -> tuple[list[int], list[int]]:
    """Two groups of positions 0..m-1: the two subtrees under the root of the complete-linkage
    dendrogram on 1 - cos (the same split as on -cos: complete linkage ignores a constant shift).
    The group holding position 0 comes first; both sorted."""
    m = gram.shape[0]
    if m < 2:
        raise ValueError(f"bipartition needs at least 2 updates, got {m}")
    root = to_tree(linkage(squareform(cosine_distances(gram), checks=False), method="complete"))
    left, right = sorted(root.get_left().pre_order()), sorted(root.get_right().pre_order())
    return (left, right) if 0 in left else (right, left)


@register
class CFL(Algorithm):
    name = "cfl"
    description = "CFL: one cluster split recursively by the cosine of client updates once the mean update stalls"
    evaluated_model = "custom"  # the model of the client's cluster

    class Hyper(HyperParams):
        """CFL hyperparameters (spec baselines.md "CFL").

        eps1: split only if the norm of the cluster's mean update is below eps1 (0.4 [code: FL-bench];
            cwFedAvg used 0.4).
        eps2: ... and the largest client update norm is above eps2 (1.6 [code: FL-bench]; cwFedAvg 0.9).
        warmup: no split before this round (20 [code: FL-bench start_clustering_round]).
        min_cluster_size: split only a cluster with more than this many participants this round
            (2 [code: FL-bench]).
        update_weighting: weights of the mean update (and of mean_norm): "samples" = n_i
            [paper], "uniform" = 1/|P_c| [code: FL-bench].
        """

        eps1: float = Field(0.4, ge=0, description="split if ||mean update|| < eps1 ...")
        eps2: float = Field(1.6, ge=0, description="... and max ||client update|| > eps2")
        warmup: int = Field(20, ge=0, description="first round in which a cluster may split")
        min_cluster_size: int = Field(2, ge=1, description="split only clusters with more participants than this")
        update_weighting: Literal["samples", "uniform"] = Field(
            "samples", description="mean update weights: n_i (paper) or uniform (FL-bench)")

    # --- state -------------------------------------------------------------------------------

    def init_server(self, params: Params) -> dict[str, Any]:
        return {"models": [clone(params)],
                "membership": np.zeros(self.setup.num_clients, dtype=np.int64)}  # cluster of each client

    # --- round -------------------------------------------------------------------------------

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        return {cid: {"params": server["models"][int(server["membership"][cid])]} for cid in cids}

    def client_update(self, rnd: int, cid: int, client: Any, message: Message, data: ClientData) -> ClientUpdate:
        trained = yield Fit(message["params"])
        return client, {"params": trained, "weight": data.n_train}

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        """Split the clusters that meet the criterion, then move every cluster model by the mean
        update of its participating members."""
        models, membership = list(server["models"]), server["membership"].copy()
        ordered = sorted(replies)
        count = len(models)
        mean_norms, max_norms, splits = np.full(count, np.nan), np.full(count, np.nan), []
        for c in range(count):
            members = [cid for cid in ordered if membership[cid] == c]
            if not members:
                continue
            gram = update_gram(models[c], [replies[cid]["params"] for cid in members])
            mean_norms[c], max_norms[c] = update_norms(gram, self._weights(members, replies))
            if should_split(mean_norms[c], max_norms[c], len(members), rnd, eps1=self.hyper.eps1, eps2=self.hyper.eps2,
                            warmup=self.hyper.warmup, min_cluster_size=self.hyper.min_cluster_size):
                _, moved = bipartition(gram)
                membership[[members[p] for p in moved]] = len(models)
                splits.append([c, len(models)])
                models.append(models[c])  # the new cluster starts from w_c
        if ordered:
            weights = clusters.one_hot_weights([int(membership[c]) for c in ordered],
                                               self._weights(ordered, replies), len(models))
            models = clusters.cluster_means(models, [replies[cid]["params"] for cid in ordered], weights)
        self._record(rnd, membership, mean_norms, max_norms, splits)
        return {"models": models, "membership": membership}

    def _weights(self, cids: list[int], replies: dict[int, Message]) -> list[float]:
        if self.hyper.update_weighting == "uniform":
            return [1.0] * len(cids)
        return [float(replies[cid]["weight"]) for cid in cids]

    def _record(self, rnd: int, membership: np.ndarray, mean_norms: np.ndarray, max_norms: np.ndarray,
                splits: list[list[int]]) -> None:
        self.record(rnd, "cluster_assignment", membership.copy())  # every client's cluster (server-side)
        self.record(rnd, "mean_norm", mean_norms)  # per cluster before this round's splits; NaN: no participant
        self.record(rnd, "max_norm", max_norms)
        self.record(rnd, "thresholds", np.array([self.hyper.eps1, self.hyper.eps2]))  # for the report's lines
        if splits:
            self.record(rnd, "splits", np.asarray(splits, dtype=np.int64))  # rows: [split cluster, new cluster]

    def client_model(self, cid: int, server: dict, client: Any) -> Params:
        return server["models"][int(server["membership"][cid])]

    def joining_model(self, cid: int, server: dict, client: Any, data: ClientData) -> Params:
        """A newcomer has no update to split by (its membership entry is cluster 0 only because it
        was never moved): it takes the cluster model with the lowest loss on its training data
        [ours, IFCA's rule]."""
        from pfedkit.algorithms.ifca import choose_cluster

        cluster, _ = choose_cluster(self.setup.ops_for(cid), server["models"], data)
        return server["models"][cluster]
