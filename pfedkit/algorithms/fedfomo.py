"""FedFomo (Zhang, Sapra, Fidler, Yeung, Alvarez, ICLR 2021): first-order model optimisation.

Spec: shared/specs/baselines.md, "FedFomo". The server stores every client's latest model
(initially the initial model) and an affinity matrix P [N, N] (initially the identity). A round,
per participant i:

1. download the M models of OTHER clients with the largest P[i, j] (ties -> lowest j), each slot
   replaced with probability eps_t = epsilon * epsilon_decay^(t-1) by a uniformly drawn other
   client not yet chosen (epsilon-greedy exploration), with their client ids;
2. on its validation split (ceil(val_ratio n) positions of its training set drawn at random once
   per client and seed, never trained on; not the last positions: the datasets store rows sorted
   by label, so those would hold one class) compute the losses L(theta_old) of its own model and
   L(theta_j) of each download, the ratios
   r_ij = (L(theta_old) - L(theta_j)) / (||theta_j - theta_old||_2 + 1e-5) and the weights
   w_ij = max(0, r_ij) normalised to sum 1 (all 0: keep theta_old);
3. theta_i = theta_old + sum_j w_ij (theta_j - theta_old) (= sum_j w_ij theta_j), then E epochs on
   the other positions of its training set;
4. upload theta_i and the unclipped ratios r_ij; the server stores theta_i and adds r_ij into
   P[i, j] (negative ratios lower j's future rank).

Client state: its model theta_i (the initial model until it takes part). Evaluated: that model.
Communication per participant: down M models + M client ids, up one model + M ratios.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from pydantic import Field

from pfedkit.algorithms.peers import mix, mixing_matrix
from pfedkit.algorithms.registry import register
from pfedkit.algorithms.scoring import mean_loss
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, HyperParams, Message
from pfedkit.core.errors import ConfigError, ConfigWarning
from pfedkit.core.params import Params, clone, flatten
from pfedkit.core.seeds import SERVER, numpy_rng

DISTANCE_EPS = 1e-5  # the 1e-5 added to ||theta_j - theta_old|| [paper/code]


# ---------------------------------------------------------------------------------------------
# Pure math
# ---------------------------------------------------------------------------------------------

def exploration_rate(rnd: int, epsilon: float, decay: float) -> float:
    """eps_t = epsilon * decay^(t - 1)."""
    return float(epsilon * decay ** (rnd - 1))


def top_peers(p_row: np.ndarray, me: int, count: int) -> list[int]:
    """The `count` clients j != me with the largest p_row[j] (ties -> lowest j), best first."""
    others = [j for j in range(len(p_row)) if j != me]
    return sorted(others, key=lambda j: (-float(p_row[j]), j))[:count]


def choose_peers(p_row: np.ndarray, me: int, count: int, eps: float, rng: np.random.Generator) -> list[int]:
    """Top-`count` peers, each slot (in rank order) replaced with probability eps by a uniformly
    drawn other client not in the current selection (one uniform draw per slot, always)."""
    chosen = top_peers(p_row, me, count)
    for slot in range(len(chosen)):
        explore = rng.random() < eps
        if explore:
            pool = [j for j in range(len(p_row)) if j != me and j not in chosen]
            if pool:
                chosen[slot] = pool[int(rng.integers(len(pool)))]
    return chosen


def validation_size(n: int, ratio: float) -> int:
    """ceil(ratio n), at least 1 and leaving at least 1 sample to train on (needs n >= 2)."""
    if n < 2:
        raise ValueError(f"fedfomo needs at least 2 training samples per client, got {n}")
    return min(max(1, math.ceil(ratio * n)), n - 1)


def validation_split(n: int, ratio: float, seed: int, cid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training, validation) positions of a client's n training samples: validation_size(n, ratio)
    of them drawn uniformly at random from (seed, cid), the same every round, each sorted."""
    order = numpy_rng(seed, 0, cid, "fedfomo-validation").permutation(n)
    held_out = validation_size(n, ratio)
    return torch.from_numpy(np.sort(order[held_out:])), torch.from_numpy(np.sort(order[:held_out]))


def parameter_distance(a: Params, b: Params) -> float:
    """||a - b||_2 over all parameters, float64."""
    return float(torch.linalg.vector_norm(flatten(a).double() - flatten(b).double()))


def improvement_ratios(own_loss: float, peer_losses: Sequence[float], distances: Sequence[float]) -> np.ndarray:
    """r_j = (L(theta_old) - L(theta_j)) / (||theta_j - theta_old||_2 + 1e-5) (unclipped, float64)."""
    losses = np.asarray(peer_losses, dtype=np.float64)
    return (float(own_loss) - losses) / (np.asarray(distances, dtype=np.float64) + DISTANCE_EPS)


def fomo_weights(ratios: np.ndarray) -> np.ndarray:
    """w_j = max(0, r_j) / sum_j' max(0, r_j'); all zeros when no r_j is positive (keep theta_old)."""
    clipped = np.maximum(np.asarray(ratios, dtype=np.float64), 0.0)
    total = clipped.sum()
    return clipped / total if total > 0 else clipped


def fomo_update(own: Params, peers: Sequence[Params], weights: np.ndarray) -> Params:
    """theta_old + sum_j w_j (theta_j - theta_old); with sum w = 1 this is sum_j w_j theta_j
    (`peers.mix`), with all w = 0 it is theta_old."""
    if not len(weights) or np.sum(weights) <= 0:
        return own
    return mix(peers, weights, "FedFomo weights")


# ---------------------------------------------------------------------------------------------
# The algorithm
# ---------------------------------------------------------------------------------------------

@register
class FedFomo(Algorithm):
    name = "fedfomo"
    description = "FedFomo: download top-M peers by affinity, mix by validation-loss improvement per distance"
    evaluated_model = "own"
    quick_test_options = {"num_peers": 3}  # (5 by default: more than a 4-client run has, with a warning)

    class Hyper(HyperParams):
        """FedFomo hyperparameters (spec baselines.md "FedFomo").

        num_peers: M, models downloaded per round (5 [paper/code]); clipped to N - 1 [code: PFLlib
            clips it to the participants].
        val_ratio: share of the training set held out for the weights: ceil(val_ratio n) positions
            drawn at random once per client, at least 1 sample and leaving at least 1 (0.2 [paper/code]).
        epsilon: initial exploration probability per downloaded slot (0.3 [paper, schedule
            unverified]); 0 gives PFLlib's plain top-M.
        epsilon_decay: eps_t = epsilon * epsilon_decay^(t-1) (0.98 [ours]).
        """

        num_peers: int = Field(5, ge=1, description="M: peer models downloaded per round (at most N - 1 are)")
        val_ratio: float = Field(0.2, gt=0, lt=1, description="share of the training set held out as validation split")
        epsilon: float = Field(0.3, ge=0, le=1, description="initial epsilon-greedy exploration probability per slot")
        epsilon_decay: float = Field(0.98, ge=0, le=1, description="eps_t = epsilon * epsilon_decay^(t-1)")

    def check(self) -> None:
        sizes = np.asarray(self.setup.train_counts).sum(axis=1)
        small = [int(c) for c in np.flatnonzero(sizes < 2)]
        if small:
            raise ConfigError(f"fedfomo holds out a validation split, so every client needs at least 2 training "
                              f"samples; clients {small[:5]} have fewer: change the partition (e.g. partition.least)")
        if self.hyper.num_peers > self.peer_count:  # runs, but not as written: say what is used
            warnings.warn(f"fedfomo.num_peers={self.hyper.num_peers}: only {self.peer_count} other clients exist, so "
                          f"each client downloads {self.peer_count} peer models per round", ConfigWarning)

    @property
    def peer_count(self) -> int:
        return min(self.hyper.num_peers, self.setup.num_clients - 1)

    # --- state -------------------------------------------------------------------------------

    def init_server(self, params: Params) -> dict[str, Any]:
        initial = clone(params)
        n = self.setup.num_clients
        return {"models": [initial] * n, "P": np.eye(n)}

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        return {"params": clone(params)}

    # --- round -------------------------------------------------------------------------------

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        eps = exploration_rate(rnd, self.hyper.epsilon, self.hyper.epsilon_decay)
        messages = {}
        for cid in cids:
            rng = numpy_rng(self.setup.seed, rnd, SERVER, f"fedfomo-explore-{cid}")
            chosen = choose_peers(server["P"][cid], cid, self.peer_count, eps, rng)
            messages[cid] = {"models": [server["models"][j] for j in chosen], "ids": np.asarray(chosen, dtype=np.int64)}
        return messages

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        own, peers, ids = client["params"], message["models"], [int(j) for j in message["ids"]]
        fit_on, held_out = validation_split(data.n_train, self.hyper.val_ratio, self.setup.seed, cid)
        rows = held_out.to(data.x_train.device)
        ratios = self.ratios(cid, own, peers, data.x_train[rows], data.y_train[rows], data.buffers)
        start = fomo_update(own, peers, fomo_weights(ratios))
        trained = yield Fit(start, samples=fit_on)
        return {"params": trained}, {"params": trained, "ratios": dict(zip(ids, ratios.tolist()))}

    def ratios(self, cid: int, own: Params, peers: Sequence[Params], x: torch.Tensor, y: torch.Tensor,
               buffers: Params | None) -> np.ndarray:
        """Unclipped r_ij of each downloaded model on the validation split (eval mode, own buffers)."""
        ops = self.setup.ops_for(cid)
        own_loss = mean_loss(ops, own, x, y, buffers)
        losses = [mean_loss(ops, peer, x, y, buffers) for peer in peers]
        return improvement_ratios(own_loss, losses, [parameter_distance(peer, own) for peer in peers])

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        models, affinity = list(server["models"]), server["P"].copy()
        rows = {}
        for cid in sorted(replies):
            models[cid] = replies[cid]["params"]
            peers = sorted(replies[cid]["ratios"])
            ratios = np.array([replies[cid]["ratios"][j] for j in peers], dtype=np.float64)
            affinity[cid, peers] += ratios
            rows[cid] = self.mixing_row(cid, peers, ratios)
        self.record(rnd, "weights", mixing_matrix(self.setup.num_clients, rows))
        self.record(rnd, "P", affinity.astype(np.float32))
        return {"models": models, "P": affinity}

    @staticmethod
    def mixing_row(cid: int, peers: list[int], ratios: np.ndarray) -> dict[int, float]:
        """The client's mix as a row over clients: the peers' w_ij, or 1 on itself when it kept theta_old."""
        weights = fomo_weights(ratios)
        if weights.sum() <= 0:
            return {cid: 1.0}
        return dict(zip(peers, weights.tolist()))

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        return client["params"]

    def new_client_refusal(self) -> str:
        return ("a client's model is its own mixture of the peers it chose by affinities learned over its "
                "own past rounds, which a newcomer does not have")
