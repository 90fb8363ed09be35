"""FedSoft (Ruan, Joe-Wong, AAAI 2022): soft clustered FL with proximal local updating.

Spec: shared/specs/baselines.md, "FedSoft" (code `ycruan/FedSoft`). The server keeps S centre
models c_s, differently initialised (`reinitialised_models`: centre 0 is the run's initial
model). Each client keeps a persistent local model w_k and importance weights u_k (one per
centre, initially 1/S). A round, per participant k:

1. download all S centres and whether importance weights are re-estimated this round (rounds
   1, 1 + tau, 1 + 2 tau, ...);
2. if so: n_ks = number of its training samples whose loss is smallest under centre s (ties ->
   lowest s), n_ks = 0 -> sigma n_k, u_ks = n_ks / n_k;
3. train its OWN local model E epochs on CE + sum_s (lam/2) u_ks ||w - c_s||^2 (all parameters);
4. upload w_k, u_k and n_k.

The server forms v_sk = u_ks n_k / sum_k' u_k's n_k' over the round's participants and rebuilds
each centre: c_s = sum_k v_sk w_k (default), or with `selection_size` = K the uniform mean of K
participants drawn without replacement with probabilities v_s. (The paper's server selects the K
clients per centre before training; here the engine picks the round's participants and the
selection is made among them [ours].)

With partial participation a client absent in the estimation rounds keeps stale (initially
uniform) weights; `catch_up` makes it estimate at its next participation [ours].

Client state: w_k, u_k and the round of its latest estimation. Evaluated: the local model w_k
(the initial model until the client takes part). Communication per participant: down S models +
a flag, up one model + S importance weights + n_k.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
from pydantic import Field

from pfedkit.algorithms.clusters import UNASSIGNED, cluster_means, seeded_models
from pfedkit.algorithms.registry import register
from pfedkit.algorithms.scoring import sample_losses
from pfedkit.core.contract import (Algorithm, ClientData, ClientUpdate, cross_entropy, Fit, Forward, HyperParams, Message)
from pfedkit.core.errors import ConfigError
from pfedkit.core.params import Params, clone, squared_distance, weighted_mean
from pfedkit.core.seeds import SERVER, numpy_rng
from pfedkit.core.search import float_range

INIT_PURPOSE = "fedsoft-init"


# ---------------------------------------------------------------------------------------------
# Pure math
# ---------------------------------------------------------------------------------------------

def is_estimation_round(rnd: int, tau: int) -> bool:
    """Importance weights are re-estimated in rounds 1, 1 + tau, 1 + 2 tau, ..."""
    return (rnd - 1) % tau == 0


def latest_estimation_round(rnd: int, tau: int) -> int:
    """The last estimation round <= rnd: 1 + floor((rnd - 1) / tau) tau."""
    return 1 + (rnd - 1) // tau * tau


def importance_weights(losses: np.ndarray | torch.Tensor, sigma: float) -> np.ndarray:
    """u_k [S] from per-sample losses [S, n] (centre s, sample i):
    n_ks = #{i : argmin_s' loss[s', i] = s} (ties -> lowest s), n_ks = 0 -> sigma n_k,
    u_ks = n_ks / n_k (float64; sums to 1 + sigma * (#empty centres))."""
    losses = np.asarray(losses, dtype=np.float64)
    if losses.ndim != 2 or losses.shape[1] == 0:
        raise ValueError(f"importance_weights: losses must be [S, n] with n > 0, got {losses.shape}")
    n = losses.shape[1]
    counts = np.bincount(np.argmin(losses, axis=0), minlength=losses.shape[0]).astype(np.float64)
    counts[counts == 0] = sigma * n
    return counts / n


def centre_weights(importance: np.ndarray, sizes: Sequence[float]) -> np.ndarray:
    """v [S, m]: v_sk = u_ks n_k / sum_k' u_k's n_k' over the m uploading clients
    (importance: [m, S] rows u_k; sizes: n_k). Each row of v sums to 1."""
    importance = np.asarray(importance, dtype=np.float64)
    sizes = np.asarray(sizes, dtype=np.float64)
    if importance.ndim != 2 or importance.shape[0] != sizes.size:
        raise ValueError(f"centre_weights: importance must be [m, S] with m = {sizes.size}, got {importance.shape}")
    raw = (importance * sizes[:, None]).T  # [S, m]
    totals = raw.sum(axis=1, keepdims=True)
    if (totals <= 0).any():
        raise ValueError("centre_weights: every centre needs a positive total importance")
    return raw / totals


def select_for_centre(v_row: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """Positions of `size` clients drawn without replacement with probabilities v_row (at most as
    many as have a positive probability), sorted."""
    v_row = np.asarray(v_row, dtype=np.float64)
    size = min(size, int((v_row > 0).sum()))
    chosen = rng.choice(v_row.size, size=size, replace=False, p=v_row / v_row.sum())
    return np.sort(chosen)


def soft_proximal_loss(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any], *,
                       lam: float) -> torch.Tensor:
    """CE + sum_s (lam/2) u_s ||w - c_s||^2, c_s = context["centres"][s], u = context["importance"]."""
    loss = cross_entropy(out, y, params, context)
    if lam == 0:
        return loss
    importance = context["importance"]
    for s, centre in enumerate(context["centres"]):
        loss = loss + 0.5 * lam * importance[s] * squared_distance(params, centre)
    return loss


# ---------------------------------------------------------------------------------------------
# The algorithm
# ---------------------------------------------------------------------------------------------

@register
class FedSoft(Algorithm):
    name = "fedsoft"
    description = "FedSoft: S soft-clustered centres, local models pulled to each centre by importance weights"
    evaluated_model = "own"

    class Hyper(HyperParams):
        """FedSoft hyperparameters (spec baselines.md "FedSoft").

        num_centres: S, the number of centres (3 [ours; DA-PFL's 20-client setting]).
        tau: importance weights are re-estimated every tau rounds (2 [paper/code]).
        sigma: smoothing sigma: a centre no sample prefers gets n_ks = sigma n_k (1e-4 [code]).
        lam: proximal weight lambda (0.1 [paper, MNIST/EMNIST]; 0.01 for the CIFAR-10 CNN).
        catch_up: a participant that was absent in the latest estimation round estimates at its
            next participation (False [ours, default]: only participants of the estimation rounds
            estimate; in the paper every client estimates then, which True approximates under
            partial participation).
        selection_size: K clients drawn per centre among the round's participants with
            probabilities v_s, centre = their uniform mean [paper/code, K = 15 in the main script];
            None (default) [ours]: centre = sum_k v_sk w_k over all participants (the engine already
            chooses the participants).
        """

        num_centres: int = Field(3, ge=1, description="S: number of centre models")
        tau: int = Field(2, ge=1, description="re-estimate importance weights every tau rounds")
        sigma: float = Field(1e-4, gt=0, le=1, description="n_ks of a centre no sample prefers, as a fraction of n_k")
        lam: float = Field(0.1, ge=0, description="proximal weight lambda of the local objective",
                           json_schema_extra=float_range(0.01, 1.0, log=True))
        catch_up: bool = Field(False, description="a participant that missed the latest estimation round estimates now")
        selection_size: int | None = Field(
            None, ge=1, description="K clients drawn per centre with probabilities v_s (None: v-weighted mean of all)")

    def check(self) -> None:
        if self.hyper.selection_size is not None and self.hyper.selection_size > self.setup.num_clients:
            raise ConfigError(f"fedsoft.selection_size={self.hyper.selection_size} exceeds num_clients="
                              f"{self.setup.num_clients}; set it to at most {self.setup.num_clients} (or None)")

    # --- state -------------------------------------------------------------------------------

    def init_server(self, params: Params) -> dict[str, Any]:
        centres = seeded_models(self.setup.ops.build, params, self.hyper.num_centres, self.setup.seed, INIT_PURPOSE)
        known = np.full((self.setup.num_clients, self.hyper.num_centres), np.nan)
        return {"centres": centres, "importance": known}  # importance: latest u_k received (NaN: none yet)

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        return {"params": clone(params), "importance": np.full(self.hyper.num_centres, 1.0 / self.hyper.num_centres),
                "estimated_at": 0}  # round of the client's latest estimation (0: never)

    # --- round -------------------------------------------------------------------------------

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        estimate = is_estimation_round(rnd, self.hyper.tau)
        return {cid: {"centres": server["centres"], "estimate": estimate} for cid in cids}

    def estimate(self, cid: int, centres: Sequence[Params], data: ClientData) -> np.ndarray:
        """u_k from the client's training samples' losses under each centre (eval mode, own buffers)."""
        ops = self.setup.ops_for(cid)
        losses = torch.stack([sample_losses(ops, centre, data.x_train, data.y_train, data.buffers)
                              for centre in centres])
        return importance_weights(losses.numpy(), self.hyper.sigma)

    def should_estimate(self, rnd: int, client: dict, message: Message) -> bool:
        """An estimation round (the server's flag), or with `catch_up` a client whose latest
        estimation is older than the latest estimation round."""
        missed = client["estimated_at"] < latest_estimation_round(rnd, self.hyper.tau)
        return bool(message["estimate"]) or (self.hyper.catch_up and missed)

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        centres = message["centres"]
        if self.should_estimate(rnd, client, message):
            importance, estimated_at = self.estimate(cid, centres, data), rnd
        else:
            importance, estimated_at = client["importance"], client["estimated_at"]
        context = {"centres": centres, "importance": torch.as_tensor(importance, dtype=torch.float32)}
        trained = yield Fit(client["params"], loss=partial(soft_proximal_loss, lam=self.hyper.lam), context=context)
        return ({"params": trained, "importance": importance, "estimated_at": estimated_at},
                {"params": trained, "importance": np.asarray(importance, dtype=np.float64), "weight": data.n_train})

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        known = server["importance"].copy()
        for cid, reply in replies.items():
            known[cid] = reply["importance"]
        self.record_assignment(rnd, known)
        if not replies:
            return {**server, "importance": known}
        ordered = sorted(replies)
        uploads = [replies[c]["params"] for c in ordered]
        v = centre_weights(np.stack([replies[c]["importance"] for c in ordered]),
                           [replies[c]["weight"] for c in ordered])
        if self.hyper.selection_size is None:
            centres = cluster_means(server["centres"], uploads, v)
        else:
            centres = [self.selected_mean(rnd, s, v[s], uploads) for s in range(self.hyper.num_centres)]
        return {"centres": centres, "importance": known}

    def selected_mean(self, rnd: int, s: int, v_row: np.ndarray, uploads: list[Params]) -> Params:
        """Centre s = uniform mean of `selection_size` uploads drawn with probabilities v_s."""
        rng = numpy_rng(self.setup.seed, rnd, SERVER, f"fedsoft-select-{s}")
        chosen = select_for_centre(v_row, self.hyper.selection_size, rng)
        return weighted_mean([uploads[i] for i in chosen], [1.0] * len(chosen))

    def record_assignment(self, rnd: int, known: np.ndarray) -> None:
        seen = ~np.isnan(known).any(axis=1)
        assignment = np.full(known.shape[0], UNASSIGNED, dtype=np.int64)
        assignment[seen] = np.argmax(known[seen], axis=1)
        self.record(rnd, "cluster_weights", known.astype(np.float32))
        self.record(rnd, "cluster_assignment", assignment)

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        return client["params"]

    def joining_model(self, cid: int, server: dict, client: dict, data: ClientData) -> Params:
        """A newcomer has no local model yet: it takes the centre with the lowest loss on its
        training data [ours, IFCA's rule; the centre most of its importance would go to]."""
        from pfedkit.algorithms.ifca import choose_cluster

        centre, _ = choose_cluster(self.setup.ops_for(cid), server["centres"], data)
        return server["centres"][centre]
