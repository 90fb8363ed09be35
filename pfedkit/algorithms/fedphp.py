"""FedPHP (Li, Zhan, Shao, Li, Song, *FedPHP: Federated Personalization with Inherited Private
Models*, ECML-PKDD 2021): each client keeps an inherited private model (HPM), a moving average of
its past local models, and distils it into the next local training.

Round t, participant i with HPM v_i (initially the initial model), having taken part k_i times:
  1. it receives the global model w^t and trains a local model w_i from it, E epochs on
        L = (1 - lam) CE(z, y) + lam R                                             (eq. 1)
     with R the knowledge transferred from the frozen HPM (eval mode, computed once per round for
     every training sample, read per batch through `Forward.index`):
        "mmd": R = MMD^2(h_batch, h^HPM_batch), a Gaussian-kernel MMD between the batch's features
               and the HPM's features of the same samples;
        "kd":  R = -(1/B) sum_b sum_c softmax(z^HPM_b / tau)_c log softmax(z_b)_c;
  2. it updates the HPM, v_i <- mu v_i + (1 - mu) w_i, with the momentum schedule
        "participations": mu = min(m k_i / K, m), K = max(floor(P T / N), 1) the participations
               a client expects in the run (P participants of the round, T rounds) [code: authors];
        "rounds": mu = m (t - 1) / T [code: PFLlib];
  3. it uploads w_i; the server averages the uploads (FedAvg, n_i weights).
Evaluated model: the HPM v_i (`evaluate_with="local"`: the latest local model w_i, PFLlib's).

Momentum m = 0 and lam = 0: v_i is the latest local model and the training plain CE from w^t, so
the server is FedAvg's exactly and the evaluated model is FedAvg's model right after the client's
local training (FedAvg with eval_point=after_local_training; tested).

The paper's text was not retrievable here; the steps, the defaults and the kernels follow the
first author's code (lxcnju/FedRepo, algorithms/fedphp.py): docs/algorithms/fedphp.md.
"""
from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from pfedkit.algorithms.registry import register
from pfedkit.core.aggregation import MeanOfUploads
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, cross_entropy, Fit, Forward, HyperParams, Message
from pfedkit.core.params import Params, clone, interpolate
from pfedkit.core.search import choices, float_range

TEACHER = "teacher"  # the Fit context's [rows, d] (mmd) or [rows, C] (kd) HPM outputs, row = sample
CHUNK = 1000  # samples per forward when computing the HPM's outputs (memory bound only)
ADAPTIVE_KERNELS, ADAPTIVE_MULTIPLIER = 5, 2.0  # the authors' Gaussian kernel family
PFLLIB_BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)    # PFLlib's fixed "rbf" bandwidths


# ---------------------------------------------------------------------------------------------
# The math (pure functions)


def squared_distances(points: torch.Tensor) -> torch.Tensor:
    """[n, n] ||p_a - p_b||^2 between the rows of `points` [n, d]."""
    return (points.unsqueeze(1) - points.unsqueeze(0)).square().sum(dim=2)


def adaptive_kernel_mmd(source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """MMD^2 estimate mean(K_ss + K_tt - K_st - K_ts) [code: authors] with K = sum_{i<5} exp(-D / s_i),
    D the squared distances over the 2B stacked points, s_i = s 2^(i-2) and s the mean off-diagonal
    D (a constant: no gradient flows through the bandwidth)."""
    rows = source.shape[0]
    distances = squared_distances(torch.cat([source, target]))
    n = distances.shape[0]
    scale = distances.detach().sum() / (n * n - n) + 1e-8
    base = scale / ADAPTIVE_MULTIPLIER ** (ADAPTIVE_KERNELS // 2)
    kernel = sum(torch.exp(-distances / (base * ADAPTIVE_MULTIPLIER ** i)) for i in range(ADAPTIVE_KERNELS))
    within_s, within_t = kernel[:rows, :rows], kernel[rows:, rows:]
    across = kernel[:rows, rows:] + kernel[rows:, :rows]
    return (within_s + within_t - across).mean()


def fixed_kernel_mmd(source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """PFLlib's MMD: mean(K_ss + K_tt - 2 K_st), K = sum_a exp(-D / (2a)) over a in 10, 15, 20, 50."""
    def kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        distances = (a.unsqueeze(1) - b.unsqueeze(0)).square().sum(dim=2)
        return sum(torch.exp(-0.5 * distances / width) for width in PFLLIB_BANDWIDTHS)
    return (kernel(source, source) + kernel(target, target) - 2.0 * kernel(source, target)).mean()


def soft_target_cross_entropy(logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """-(1/B) sum_b sum_c softmax(t_b / tau)_c log softmax(z_b)_c: the teacher softened, the student not [code: authors]."""
    targets = F.softmax(teacher_logits / temperature, dim=1)
    return -(targets * F.log_softmax(logits, dim=1)).sum(dim=1).mean()


def transfer_term(out: Forward, teacher: torch.Tensor, transfer: str, kernel: str, temperature: float) -> torch.Tensor:
    """R of eq. 1 for the batch, `teacher` = the HPM's outputs of the batch's samples."""
    if transfer == "kd":
        return soft_target_cross_entropy(out.logits, teacher, temperature)
    mmd = adaptive_kernel_mmd if kernel == "adaptive" else fixed_kernel_mmd
    return mmd(out.features, teacher)


def fedphp_loss(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any], *, lam: float,
                transfer: str = "mmd", kernel: str = "adaptive", temperature: float = 4.0) -> torch.Tensor:
    """Eq. 1: (1 - lam) CE + lam R, R from the HPM's outputs context[TEACHER][out.index].
    lam = 0 is exactly the cross-entropy (no context needed)."""
    loss = cross_entropy(out, y, params, context)
    if lam == 0:
        return loss
    teacher = context[TEACHER][out.index]
    return (1.0 - lam) * loss + lam * transfer_term(out, teacher, transfer, kernel, temperature)


def participation_momentum(momentum: float, participations: int, expected: int) -> float:
    """mu = min(m k / K, m) [code: authors]: k earlier participations of K expected in the run."""
    return min(momentum * participations / expected, momentum)


def round_momentum(momentum: float, rnd: int, rounds: int) -> float:
    """mu = m (t - 1) / T [code: PFLlib, whose rounds count from 0]."""
    return momentum * (rnd - 1) / max(rounds, 1)


def expected_participations(participants: int, num_clients: int, rounds: int) -> int:
    """K = max(floor(P T / N), 1): a client's expected participations [code: authors: int(c_ratio T)]."""
    return max(participants * max(rounds, 1) // num_clients, 1)


def inherit(inherited: Params, local: Params, mu: float) -> Params:
    """v <- mu v + (1 - mu) w (step 2); mu = 0 gives the local model itself."""
    return clone(local) if mu == 0 else interpolate(local, inherited, mu)


@torch.no_grad()
def teacher_outputs(ops: Any, params: Params, x: torch.Tensor, buffers: Params | None, rows: int,
                    kind: str) -> torch.Tensor:
    """The HPM's features ("mmd") or logits ("kd") of every training sample, eval mode, row i =
    sample i, zero rows past len(x): every client's context padded to one shape `rows`, so the
    vectorized runtime trains them as one group."""
    forward = ops.features if kind == "mmd" else ops.logits
    values = forward(params, x, buffers, chunk=CHUNK).float()
    padded = values.new_zeros(max(rows, len(x)), values.shape[1])
    padded[:len(x)] = values
    return padded


# ---------------------------------------------------------------------------------------------
# The algorithm


@register
class FedPHP(MeanOfUploads, Algorithm):
    name = "fedphp"
    description = "FedPHP: inherited private model (moving average of local models) distilled into local training"
    evaluated_model = "custom"  # the HPM v_i = mu v_i + (1 - mu) w_i after the client's last training

    class Hyper(HyperParams):
        """FedPHP hyperparameters (docs/algorithms/fedphp.md).

        lam: weight of the transfer term, (1 - lam) CE + lam R; 0.1 with "mmd" [code: authors'
            runs: MMD 0.1 or 0.05, KD 0.05].
        transfer: "mmd" (features) or "kd" (logits, teacher softened by `temperature`) [code: authors].
        kernel: the MMD's kernels, "adaptive" (5 Gaussians around the mean pairwise distance)
            [code: authors] or "pfllib" (fixed bandwidths 10, 15, 20, 50) [code: PFLlib].
        temperature: tau of "kd", 4 [code: authors].
        momentum: m, the largest HPM momentum, 0.9 [code: authors].
        schedule: "participations" (mu grows with the client's own participations) [code: authors]
            or "rounds" (mu grows with the round) [code: PFLlib].
        evaluate_with: "inherited" (the HPM) [code: authors] or "local" (the latest local model) [code: PFLlib].
        """
        lam: float = Field(0.1, ge=0, le=1, description="weight of the HPM transfer term: (1 - lam) CE + lam R",
                           json_schema_extra=float_range(0.01, 0.5, log=True))
        transfer: Literal["mmd", "kd"] = Field("mmd", description="transfer from the HPM: feature MMD or logit KD",
                                               json_schema_extra=choices("mmd", "kd"))
        kernel: Literal["adaptive", "pfllib"] = Field(
            "adaptive", description="MMD kernels: the authors' adaptive Gaussians or PFLlib's fixed bandwidths")
        temperature: float = Field(4.0, gt=0, description="KD: temperature of the HPM's soft labels")
        momentum: float = Field(0.9, ge=0, lt=1, description="m: the HPM's largest momentum",
                                json_schema_extra=float_range(0.5, 0.95))
        schedule: Literal["participations", "rounds"] = Field(
            "participations", description="mu grows with the client's participations (authors) or the round (PFLlib)")
        evaluate_with: Literal["inherited", "local"] = Field(
            "inherited", description="the evaluated model: the HPM (authors) or the latest local model (PFLlib)")

    def init_server(self, params: Params) -> dict[str, Any]:
        return {"params": clone(params)}

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        state = {"inherited": clone(params), "participations": 0}
        if self.hyper.evaluate_with == "local":
            state["local"] = clone(params)
        return state

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        message = {"params": server["params"]}
        if self.hyper.schedule == "participations":
            message["expected"] = expected_participations(len(cids), self.setup.num_clients, self.setup.rounds)
        return {cid: message for cid in cids}

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        h = self.hyper
        loss = partial(fedphp_loss, lam=h.lam, transfer=h.transfer, kernel=h.kernel, temperature=h.temperature)
        local = yield Fit(message["params"], loss=loss, context=self.teacher_context(cid, client, data))
        state = {"inherited": inherit(client["inherited"], local, self.momentum(rnd, client, message)),
                 "participations": client["participations"] + 1}
        if h.evaluate_with == "local":
            state["local"] = local
        return state, {"params": local, "weight": data.n_train}

    def teacher_context(self, cid: int, client: dict, data: ClientData) -> dict[str, torch.Tensor]:
        """The HPM's outputs for every training sample (none when lam = 0: plain CE)."""
        if self.hyper.lam == 0:
            return {}
        rows = int(np.asarray(self.setup.train_counts).sum(axis=1).max())
        return {TEACHER: teacher_outputs(self.setup.ops_for(cid), client["inherited"], data.x_train,
                                         data.buffers, rows, self.hyper.transfer)}

    def momentum(self, rnd: int, client: dict, message: Message) -> float:
        """mu of step 2 for this client and round."""
        if self.hyper.schedule == "participations":
            return participation_momentum(self.hyper.momentum, client["participations"], int(message["expected"]))
        return round_momentum(self.hyper.momentum, rnd, self.setup.rounds)

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        return client["local"] if self.hyper.evaluate_with == "local" else client["inherited"]

    def trained_model(self, cid: int, client: dict, params: Params) -> Params:
        """After local training: the updated HPM (or, with evaluate_with=local, the local model)."""
        return self.client_model(cid, {}, client)

    def joining_model(self, cid: int, server: dict, client: dict, data: ClientData) -> Params:
        """A newcomer has no HPM yet: it receives the global model (its first HPM would be its first local model)."""
        return server["params"]
