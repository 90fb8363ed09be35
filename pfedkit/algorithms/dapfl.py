"""DA-PFL (Yang et al., arXiv:2403.09284; IEEE TNNLS 2025): dynamic affinity aggregation.

Spec: seed-algorithms.md §5. The whole model is aggregated and regularised (head "last" is only
used for logging). Per participant i of a round, the server mixes the OTHER participants' current
models with weights `alpha_ij ∝ c_ij (1 - exp(-(||w_i - w_j||² + eps)/sigma))` (eq. 7-9), where
`c` is a fixed affinity from the clients' class counts that favours *complementary* label
distributions (eq. 3-6). The client keeps its own model and trains it from where it was, with the
proximal pull `lambda/2 ||w - w_i^g||²` towards that mix (eq. 2/10).

How the protocol maps onto the engine's round (client_report -> collect -> broadcast ->
client_update -> aggregate), as in the paper:

* Setup (Algorithm 1, lines 1-3; §5.5 step 0): every client uploads its class counts S_i once, in
  the engine's round-0 exchange (`client_report(0)`, counted in `bytes_setup`); the server builds
  the affinity from what it received and keeps only the affinity and the counts.
* Round t: each participant uploads its current model w_j^{t-1} before the broadcast
  (`client_report(t)`), the server mixes them per participant (eq. 7-9) and sends w_i^g down, the
  client trains its own model and replies with nothing. The uploads are dropped in `aggregate`, so
  the server keeps no model between rounds: its memory is O(N^2) affinity numbers, not N models.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Annotated, Any, Literal

import numpy as np
import torch
from pydantic import Field

from pfedkit.algorithms.fedprox import proximal_loss
from pfedkit.algorithms.peers import mix, mixing_matrix
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, Forward, HyperParams, Message
from pfedkit.core.params import Params, clone, flatten
from pfedkit.core.search import float_range

# The proximal weight λ: the paper gives no value. Picked from the sweep in benchmarks/RESULTS.md
# ("DA-PFL lambda sweep": MNIST, 20 clients, Dirichlet 0.1): λ = 0.1 was best, λ = 1 cost ~2 points.
LAM_DEFAULT = 0.1
# Centred count vectors whose norm is below this (relative to the common mean) count as zero.
_ZERO_NORM = 1e-12


# ---------------------------------------------------------------------------------------------
# Affinity (eq. 3-6), computed once from the clients' class counts
# ---------------------------------------------------------------------------------------------

def overlapping_class_vectors(counts_i: np.ndarray, counts_j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eq. (3)-(4): O_ij = {k : S_ik > 0 and S_jk > 0} (sorted), E_ij = (S_ik)_{k in O_ij},
    E_ji = (S_jk)_{k in O_ij}."""
    counts_i = np.asarray(counts_i, dtype=np.float64)
    counts_j = np.asarray(counts_j, dtype=np.float64)
    shared = (counts_i > 0) & (counts_j > 0)
    return counts_i[shared], counts_j[shared]


def adjusted_cosine(e_ij: np.ndarray, e_ji: np.ndarray, *, both_constant: float = 1.0,
                    one_constant: float = 0.0) -> float:
    """Eq. (5)-(6): ACS = <E_ij - s̄, E_ji - s̄> / (||E_ij - s̄|| ||E_ji - s̄||), centred by the
    COMMON mean s̄ = (ΣE_ij + ΣE_ji) / (2|E_ij|).

    Edge cases [ours, spec §5.3]: both centred vectors zero (identical constant counts) ->
    `both_constant` (1); exactly one zero -> `one_constant` (0).
    """
    e_ij, e_ji = np.asarray(e_ij, dtype=np.float64), np.asarray(e_ji, dtype=np.float64)
    if e_ij.shape != e_ji.shape or e_ij.size == 0:
        raise ValueError(f"adjusted_cosine needs two non-empty vectors of one length, got {e_ij.shape} and {e_ji.shape}")
    common_mean = (e_ij.sum() + e_ji.sum()) / (2 * e_ij.size)
    centred_i, centred_j = e_ij - common_mean, e_ji - common_mean
    norm_i, norm_j = np.linalg.norm(centred_i), np.linalg.norm(centred_j)
    zero = _ZERO_NORM * max(1.0, abs(common_mean))
    if norm_i <= zero and norm_j <= zero:
        return float(both_constant)
    if norm_i <= zero or norm_j <= zero:
        return float(one_constant)
    return float(np.clip(centred_i @ centred_j / (norm_i * norm_j), -1.0, 1.0))


def raw_affinity(counts_i: np.ndarray, counts_j: np.ndarray, *, both_constant: float = 1.0,
                 one_constant: float = 0.0) -> float | None:
    """Eq. (5): c_ij = (|E_ij| / K) (2 - ACS_ij), in [|E|/K, 3|E|/K]; None if no class is shared."""
    e_ij, e_ji = overlapping_class_vectors(counts_i, counts_j)
    if e_ij.size == 0:
        return None
    acs = adjusted_cosine(e_ij, e_ji, both_constant=both_constant, one_constant=one_constant)
    return e_ij.size / len(counts_i) * (2.0 - acs)


def affinity(class_counts: np.ndarray, *, normalisation: str = "minmax", no_overlap: str = "global_min",
             acs_both_constant: float = 1.0, acs_one_constant: float = 0.0) -> np.ndarray:
    """Normalised affinity matrix [N, N] from training class counts [N, C] (eq. 3-6, spec §5.3).

    1. raw c_ij (eq. 5) for every pair sharing a class;
    2. pairs sharing no class get the minimum raw affinity over the pairs that do
       (`no_overlap="global_min"`, our reading; `"row_min"` takes the minimum of row i instead,
       which makes the matrix asymmetric); if no pair shares a class, every c_ij = 1;
    3. normalised to [0, 1] over the off-diagonal entries: `"minmax"` (c - min)/(max - min), all 1
       when max = min; `"max"` c / max.
    The diagonal is never used (self is excluded from aggregation) and is set to 0.
    """
    counts = np.asarray(class_counts, dtype=np.float64)
    if counts.ndim != 2:
        raise ValueError(f"affinity: class_counts must be a 2-D [clients, classes] array, got shape {counts.shape}")
    if (counts < 0).any():
        raise ValueError("affinity: class counts must be non-negative")
    if normalisation not in ("minmax", "max"):
        raise ValueError(f"affinity: normalisation must be 'minmax' or 'max', got {normalisation!r}")
    if no_overlap not in ("global_min", "row_min"):
        raise ValueError(f"affinity: no_overlap must be 'global_min' or 'row_min', got {no_overlap!r}")
    n = counts.shape[0]
    raw = np.full((n, n), np.nan)
    for i in range(n):
        for j in range(i + 1, n):
            value = raw_affinity(counts[i], counts[j], both_constant=acs_both_constant, one_constant=acs_one_constant)
            if value is not None:
                raw[i, j] = raw[j, i] = value
    off_diagonal = ~np.eye(n, dtype=bool)
    raw = _fill_no_overlap(raw, off_diagonal, no_overlap)
    normalised = np.zeros((n, n))
    if n > 1:
        normalised[off_diagonal] = _normalise(raw[off_diagonal], normalisation)
    return normalised


def _fill_no_overlap(raw: np.ndarray, off_diagonal: np.ndarray, no_overlap: str) -> np.ndarray:
    """Spec §5.3: pairs without a common class get the calculated minimum affinity."""
    known = off_diagonal & ~np.isnan(raw)
    if not known.any():
        return np.where(off_diagonal, 1.0, raw)  # no pair shares a class [ours]
    global_min = raw[known].min()
    filled = raw.copy()
    for i in range(raw.shape[0]):
        row_known = known[i]
        row_min = raw[i, row_known].min() if no_overlap == "row_min" and row_known.any() else global_min
        missing = off_diagonal[i] & ~row_known
        filled[i, missing] = row_min
    return filled


def _normalise(values: np.ndarray, normalisation: str) -> np.ndarray:
    low, high = values.min(), values.max()
    if normalisation == "max":
        return values / high  # raw affinities are >= |E|/K > 0, so high > 0
    if high - low <= 1e-12 * max(1.0, abs(high)):
        return np.ones_like(values)
    return (values - low) / (high - low)


# ---------------------------------------------------------------------------------------------
# Dynamic aggregation weights (eq. 7-9), every round
# ---------------------------------------------------------------------------------------------

def log_one_minus_exp_neg(x: np.ndarray) -> np.ndarray:
    """log(1 - e^{-x}) for x >= 0, accurate at both ends (-inf at x = 0).

    Small x: log(-expm1(-x)) (1 - exp(-1e-8) is exactly 0 in float32, which would zero every
    weight of round 1); large x: log1p(-exp(-x)) (Mächler's log1mexp switch at ln 2).
    """
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(divide="ignore"):
        return np.where(x <= np.log(2.0), np.log(-np.expm1(-x)), np.log1p(-np.exp(-np.maximum(x, np.log(2.0)))))


def aggregation_weights(affinity_row: np.ndarray, distances_sq: np.ndarray, sigma: float, eps: float,
                        zero_affinity: str = "uniform") -> np.ndarray:
    """Eq. (7)-(8): alpha_ij for one participant i over the OTHER participants j.

    theta_ij = c_ij / Σ_j' c_ij' · (1 - exp(-(||w_i - w_j||² + eps) / sigma)),
    alpha_ij = theta_ij / Σ_j' theta_ij'.
    Computed in the log domain (log c + log(1 - e^{-x}), normalised by log-sum-exp) in float64, so
    neither tiny nor huge (d + eps)/sigma underflows. The first normalisation cancels: alpha is
    unchanged when the row is scaled.

    A row whose affinities are all 0 (the client's every other participant has the minimum
    affinity, e.g. shares no class with it) leaves eq. 7 at 0/0 [ours]: `zero_affinity="uniform"`
    gives 1/(m-1) to every other participant; `"distance"` weights by the distance term alone,
    (1 - e^{-(d+eps)/sigma}) normalised. Every theta = 0 otherwise -> uniform.
    """
    row = np.asarray(affinity_row, dtype=np.float64)
    distances = np.asarray(distances_sq, dtype=np.float64)
    if row.ndim != 1 or row.shape != distances.shape:
        raise ValueError(f"aggregation_weights: affinity_row and distances_sq must be 1-D of one length, "
                         f"got {row.shape} and {distances.shape}")
    if not sigma > 0:
        raise ValueError(f"aggregation_weights: sigma must be > 0, got {sigma}")
    if eps < 0 or (row < 0).any() or (distances < 0).any():
        raise ValueError("aggregation_weights: affinities, squared distances and eps must be non-negative")
    if row.size == 0:
        return row
    if zero_affinity not in ("uniform", "distance"):
        raise ValueError(f"aggregation_weights: zero_affinity must be 'uniform' or 'distance', got {zero_affinity!r}")
    uniform = np.full(row.size, 1.0 / row.size)
    total = row.sum()
    if total <= 0:
        if zero_affinity == "uniform":
            return uniform
        row, total = np.ones(row.size), float(row.size)
    with np.errstate(divide="ignore"):
        log_theta = np.log(row / total) + log_one_minus_exp_neg((distances + eps) / sigma)
    if np.isneginf(log_theta).all():
        return uniform
    return np.exp(log_theta - np.logaddexp.reduce(log_theta))


def pairwise_squared_distances(models: Sequence[Params]) -> np.ndarray:
    """[m, m] matrix of ||w_i - w_j||² over all parameters flattened, in float64 (m(m-1)/2 pairs)."""
    vectors = [flatten(model).to(torch.float64) for model in models]
    m = len(vectors)
    distances = np.zeros((m, m))
    for i in range(m):
        for j in range(i + 1, m):
            distances[i, j] = distances[j, i] = float(((vectors[i] - vectors[j]) ** 2).sum())
    return distances


def resolve_sigma(sigma: float | str, distances_sq: np.ndarray) -> float:
    """sigma as configured, or [ours] "median": the median of the round's off-diagonal squared
    distances; if that is 0, the median of the positive ones; if none is positive (round 1: all
    models equal, where any sigma gives alpha ∝ c), 1."""
    if sigma != "median":
        return float(sigma)
    m = distances_sq.shape[0]
    values = distances_sq[~np.eye(m, dtype=bool)]
    median = float(np.median(values)) if values.size else 0.0
    if median > 0:
        return median
    positive = values[values > 0]
    return float(np.median(positive)) if positive.size else 1.0


def local_objective(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any], *, lam: float) -> torch.Tensor:
    """Eq. (2)/(10): CE(w; batch) + (lam/2) ||w - w_i^g||², w_i^g = context["anchor"] (whole model)."""
    return proximal_loss(out, y, params, context, mu=lam)


# ---------------------------------------------------------------------------------------------
# The algorithm
# ---------------------------------------------------------------------------------------------

@register
class DAPFL(Algorithm):
    name = "dapfl"
    description = "DA-PFL: affinity x model-distance weighted mix of other participants, proximal local model"
    evaluated_model = "own"
    head = "last"  # whole model aggregated; the split is only used for logging

    class Hyper(HyperParams):
        """DA-PFL hyperparameters (spec §5.6). [ours] marks a choice the paper leaves open.

        lam: proximal weight λ of eq. (2)/(10) (paper: not stated; LAM_DEFAULT [ours], from the
            sweep in benchmarks/RESULTS.md, "DA-PFL lambda sweep").
        sigma: distance scale σ of eq. (7) (paper: not stated). Default "median" [ours]: the median
            off-diagonal squared model distance of the round, so (d + ε)/σ is O(1) and the distance
            term really changes the weights; a fixed number such as 1.0 makes 1 - e^{-d/σ} ≈ 1 for
            every pair of trained models (weights ∝ affinity alone: the paper's ablation V2).
        zero_affinity: weights of a participant whose affinity row over the others is all 0:
            "uniform" over the other participants [ours, default] or "distance" term alone.
        eps: ε of eq. (7), "an infinitesimal positive number" (1e-8).
        affinity_normalisation: "minmax" (c - min)/(max - min) over off-diagonal entries [ours
            reading of "normalise to [0, 1]"]; "max" c/max keeps no-overlap pairs positive.
        no_overlap: value for pairs sharing no class: "global_min" = the minimum raw affinity of all
            overlapping pairs [ours reading, keeps symmetry]; "row_min" = of that row (asymmetric).
        acs_both_constant / acs_one_constant: ACS when both / exactly one centred count vector is
            zero (1 and 0 [ours]).
        Local epochs (1 [ours]), batch 10, lr and SGD without momentum come from the run config.
        """

        lam: float = Field(LAM_DEFAULT, ge=0, description="proximal weight λ (eq. 2/10)",
                           json_schema_extra=float_range(0.01, 1.0, log=True))
        sigma: Annotated[float, Field(gt=0)] | Literal["median"] = Field(
            "median", description="distance scale σ of eq. 7, or 'median' of the round's squared distances")
        zero_affinity: Literal["uniform", "distance"] = Field(
            "uniform", description="weights when a participant's affinity row is all 0")
        eps: float = Field(1e-8, gt=0, description="ε of eq. 7")
        affinity_normalisation: Literal["minmax", "max"] = "minmax"
        no_overlap: Literal["global_min", "row_min"] = "global_min"
        acs_both_constant: float = Field(1.0, ge=-1, le=1, description="ACS if both centred vectors are 0")
        acs_one_constant: float = Field(0.0, ge=-1, le=1, description="ACS if exactly one centred vector is 0")

    # --- state -------------------------------------------------------------------------------

    def init_server(self, params: Params) -> dict[str, Any]:
        return {"class_counts": None, "affinity": None}  # filled by the setup exchange

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        return {"params": clone(params)}

    def client_report(self, rnd: int, cid: int, client: dict, data: ClientData) -> Message:
        """Round 0: the one-off class counts S_i (§5.7). Round t: the current model w_i^{t-1}."""
        if rnd == 0:
            return {"class_counts": np.asarray(data.class_counts, dtype=np.int64)}
        return {"params": client["params"]}

    def collect(self, rnd: int, server: dict, reports: dict[int, Message]) -> dict[str, Any]:
        if rnd > 0:
            return {**server, "uploads": {cid: reports[cid]["params"] for cid in sorted(reports)}}
        if sorted(reports) != list(range(self.setup.num_clients)):
            raise ValueError(f"dapfl: the setup exchange needs every client's class counts, got {sorted(reports)}")
        counts = np.stack([reports[cid]["class_counts"] for cid in sorted(reports)])  # Algorithm 1, lines 1-3
        matrix = affinity(counts, normalisation=self.hyper.affinity_normalisation, no_overlap=self.hyper.no_overlap,
                          acs_both_constant=self.hyper.acs_both_constant, acs_one_constant=self.hyper.acs_one_constant)
        self.record(0, "affinity", matrix.astype(np.float32))
        return {"class_counts": counts, "affinity": matrix}

    # --- round -------------------------------------------------------------------------------

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        """Eq. (7)-(9) for every participant; sends w_i^g to i (nothing when i is alone)."""
        models = [server["uploads"][cid] for cid in cids]
        distances = pairwise_squared_distances(models)
        sigma = resolve_sigma(self.hyper.sigma, distances)
        rows: dict[int, dict[int, float]] = {}
        messages: dict[int, Message] = {}
        zero_rows = 0
        for pos, cid in enumerate(cids):
            others = [q for q in range(len(cids)) if q != pos]
            if not others:
                rows[cid] = {}
                messages[cid] = {}  # m = 1: w_i^g = w_i, which the client already holds
                continue
            other_cids = [cids[q] for q in others]
            row = server["affinity"][cid, other_cids]
            zero_rows += int(row.sum() <= 0)
            alpha = aggregation_weights(row, distances[pos, others], sigma, self.hyper.eps, self.hyper.zero_affinity)
            rows[cid] = dict(zip(other_cids, alpha.tolist()))
            messages[cid] = {"params": mix([models[q] for q in others], alpha, "DA-PFL eq. 8")}
        self.record(rnd, "aggregation_weights", mixing_matrix(self.setup.num_clients, rows))
        self.record(rnd, "sigma", sigma)
        self.record(rnd, "zero_affinity_rows", zero_rows)
        return messages

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        """Eq. (10): E epochs of SGD from the client's own w_i^{t-1}, pulled towards w_i^g."""
        own = client["params"]
        anchor = message.get("params", own)
        trained = yield Fit(own, loss=partial(local_objective, lam=self.hyper.lam), context={"anchor": anchor})
        return {"params": trained}, {}  # the new model goes up at the client's next participation

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        """Nothing to aggregate after training; the round's uploads are dropped (no model is kept)."""
        return {key: value for key, value in server.items() if key != "uploads"}

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        """The client's own model after its latest local training (the initial model if it never took part)."""
        return client["params"]

    def new_client_refusal(self) -> str:
        return ("its server keeps no model between rounds: a peer mixture w_i^g exists only for a round's "
                "participants, from their uploads, and needs the newcomer's class counts from the setup exchange")
