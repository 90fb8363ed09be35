"""FedCAC (Wu, Liu, Fang, Zhang, Zhou, Yang, *Bold but Cautious: Unlocking the Potential of
Personalized Federated Learning through Cautiously Aggressive Collaboration*, ICCV 2023).

Client i trains the model it received for E epochs (FedAvg's local training) and then marks its
*critical* parameters: in each parameter tensor, the top tau fraction by sensitivity

    s = |g ⊙ theta|,  g = theta_after - theta_before (the round's local update, as the authors' code),

with the authors' tie rules (`critical_mask`). It uploads the trained model and its mask m_i.
The server, over the round's participants:
  - global model: theta = sum_i n_i theta_i / sum_i n_i (FedAvg);
  - overlap of the critical sets: o_ij = 1 - ||m_i - m_j||_1 / (2 ||m_i||_1) (i != j);
  - threshold T_t = mean(o) + (t / beta) (max(o) - mean(o)) over the ordered pairs, t = round;
  - collaborators C_i = {i} ∪ {j : o_ij >= T_t}; customised model u_i = (1/|C_i|) sum_{j in C_i} theta_j;
  - client i's next model: u_i on its critical parameters, theta on the others:
        theta_i <- m_i ⊙ u_i + (1 - m_i) ⊙ theta.
So non-critical parameters are shared by everyone, critical ones only among clients whose critical
sets overlap enough, fewer as T_t rises with the rounds (beta sets the pace). The server keeps u_i
and m_i of every client that trained and composes theta_i with the current theta when it sends it
(`compose`); a client that never trained receives theta.

Evaluated model: that composition (what the client receives next). Communication: one model down;
the model + n_i + the mask (1 byte per parameter, bool) up. Paper-vs-code table:
docs/algorithms/fedcac.md.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from pydantic import Field

from pfedkit.algorithms.registry import register
from pfedkit.core.aggregation import fedavg_aggregate
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, HyperParams, Message
from pfedkit.core.params import Params, clone, weighted_mean
from pfedkit.core.search import float_range

ZERO_SENSITIVITY = 1e-10  # a top-tau threshold at or below this is replaced (the authors' rule)
NONZERO = 1e-20           # ... by the smallest sensitivity above this


# ---------------------------------------------------------------------------------------------
# The math (pure functions)


def critical_threshold(sensitivity: torch.Tensor, tau: float) -> float:
    """The authors' per-tensor threshold: the int(tau * numel)-th largest sensitivity (inf when
    that is 0 entries); when it is <= 1e-10, the smallest sensitivity above 1e-20 instead (kept
    when there is none, so a tensor that did not move is all critical, as in their code)."""
    values = sensitivity.reshape(-1)
    count = int(tau * values.numel())
    if count == 0:
        return float("inf")
    threshold = float(torch.topk(values, count).values[-1])
    if threshold <= ZERO_SENSITIVITY:
        nonzero = values[values > NONZERO]
        if nonzero.numel():
            threshold = float(nonzero.min())
    return threshold


def critical_mask(before: Params, after: Params, tau: float) -> dict[str, torch.Tensor]:
    """{name: bool mask of the critical entries}: sensitivity |(after - before) ⊙ after| >= the
    tensor's `critical_threshold`."""
    masks = {}
    for name, value in after.items():
        sensitivity = ((value - before[name]) * value).abs()
        masks[name] = sensitivity >= critical_threshold(sensitivity, tau)
    return masks


def overlap_matrix(masks: list[dict[str, torch.Tensor]]) -> np.ndarray:
    """o[i, j] = 1 - ||m_i - m_j||_1 / (2 ||m_i||_1) over all entries (diagonal: NaN; 0 when m_i is empty)."""
    flat = torch.stack([torch.cat([m.reshape(-1) for m in mask.values()]) for mask in masks]).double()
    sizes = flat.sum(dim=1)
    differences = torch.cdist(flat, flat, p=1.0)
    overlap = torch.where(sizes[:, None] > 0, 1.0 - differences / (2.0 * sizes[:, None].clamp(min=1.0)),
                          torch.zeros_like(differences)).numpy()
    np.fill_diagonal(overlap, np.nan)
    return overlap


def collaboration_threshold(overlap: np.ndarray, rnd: int, beta: float) -> float:
    """T_t = mean + (t / beta) (max - mean) over the off-diagonal overlaps (NaN without pairs)."""
    pairs = overlap[~np.isnan(overlap)]
    if pairs.size == 0:
        return float("nan")
    mean = float(pairs.mean())
    return mean + (rnd / beta) * (float(pairs.max()) - mean)


def collaborators(overlap: np.ndarray, threshold: float) -> np.ndarray:
    """[m, m] bool: row i = C_i, itself and every j with o_ij >= T_t."""
    chosen = np.nan_to_num(overlap, nan=-np.inf) >= threshold
    np.fill_diagonal(chosen, True)
    return chosen


def compose(global_: Params, customised: Params, mask: dict[str, torch.Tensor]) -> Params:
    """m ⊙ u + (1 - m) ⊙ theta, entry by entry (exact: a choice, not arithmetic)."""
    return {name: torch.where(mask[name], customised[name], value) for name, value in global_.items()}


# ---------------------------------------------------------------------------------------------
# The algorithm


@register
class FedCAC(Algorithm):
    name = "fedcac"
    description = "FedCAC: critical parameters (top tau by |update * theta|) averaged only with overlapping clients"
    evaluated_model = "custom"  # critical parameters from the customised model, the rest global

    class Hyper(HyperParams):
        tau: float = Field(0.5, gt=0, le=1, description="fraction of each parameter tensor marked critical",
                           json_schema_extra=float_range(0.1, 0.9))
        beta: float = Field(100.0, gt=0, description="pace of the collaboration threshold: T_t = mean + (t/beta)"
                            "(max - mean) of the overlaps", json_schema_extra=float_range(10.0, 300.0, log=True))

    def init_server(self, params: Params) -> dict[str, Any]:
        """The global model; customised models and critical masks of the clients that trained."""
        return {"params": clone(params), "customised": {}, "critical": {}}

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        return {cid: {"params": self.client_model(cid, server, None)} for cid in cids}

    def client_update(self, rnd: int, cid: int, client: Any, message: Message, data: ClientData) -> ClientUpdate:
        received = message["params"]
        trained = yield Fit(received)
        reply = {"params": trained, "weight": data.n_train, "critical": critical_mask(received, trained, self.hyper.tau)}
        return client, reply

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        if not replies:
            return server
        ordered = sorted(replies)
        overlap = overlap_matrix([replies[c]["critical"] for c in ordered])
        threshold = collaboration_threshold(overlap, rnd, self.hyper.beta)
        chosen = collaborators(overlap, threshold)
        customised, critical = dict(server["customised"]), dict(server["critical"])
        for row, cid in enumerate(ordered):
            peers = [ordered[k] for k in np.flatnonzero(chosen[row])]
            customised[cid] = weighted_mean([replies[j]["params"] for j in peers], [1.0] * len(peers))
            critical[cid] = replies[cid]["critical"]
        self.record_collaboration(rnd, ordered, chosen, threshold)
        return {"params": fedavg_aggregate(replies), "customised": customised, "critical": critical}

    def record_collaboration(self, rnd: int, ordered: list[int], chosen: np.ndarray, threshold: float) -> None:
        """fedcac_collaborators: [N, N], row i = C_i over the participants (NaN rows: not trained)."""
        matrix = np.full((self.setup.num_clients, self.setup.num_clients), np.nan)
        matrix[np.ix_(ordered, range(self.setup.num_clients))] = 0.0
        matrix[np.ix_(ordered, ordered)] = chosen
        self.record(rnd, "fedcac_collaborators", matrix)
        self.record(rnd, "fedcac_threshold", threshold)

    def client_model(self, cid: int, server: dict, client: Any) -> Params:
        if cid not in server["customised"]:
            return server["params"]
        return compose(server["params"], server["customised"][cid], server["critical"][cid])
