"""Client-level DP (DP-FedAvg, McMahan, Ramage, Talwar, Zhang, ICLR 2018, Algorithm 1 with the
fixed-denominator estimator).

Each round the m sampled participants start from the broadcast model w0 and upload w_i. The server
forms

    Delta_i  = w_i - w0
    clip(D)  = D * min(1, C / ||D||_2)                (||.||_2 over every uploaded entry together)
    w        = w0 + (1/m) sum_i clip(Delta_i) + N(0, (z C / m)^2 I)

with C = `dp.clip`, z = `dp.noise_multiplier` and m the number of clients SAMPLED this round (a
client that never replies counts as a zero update, so the denominator never depends on who answered).

With Poisson client sampling (`participants=poisson`: each client joins with probability q) the
count varies, so the denominator is the EXPECTED count q N instead (McMahan et al.'s fixed-
denominator estimator):

    w = w0 + (1 / (q N)) sum_i clip(Delta_i) + N(0, (z C / (q N))^2 I)

an unbiased estimate of the mean update whose sensitivity to adding or removing one client is
C / (q N) whatever the round's draw; a round nobody joined still releases w0 plus the noise.

Why uniform weights: with fixed m, adding or removing one client changes sum_i clip(Delta_i) by at
most C, so the mean moves by at most C / m: the Gaussian mechanism's sensitivity. FedAvg's
sample-size weights n_i / sum_j n_j break that bound: one client with a large n_i can carry almost
the whole mean (sensitivity up to C, not C / m), and sum_j n_j itself depends on who took part.
McMahan et al.'s bounded-weight estimator (weights min(n_i / w_hat, 1) over a fixed expected
total) would keep some weighting; it is not implemented here: DP runs average uniformly.

Where it applies: to an algorithm whose server state is that mean of uploads, i.e. an instance of
`pfedkit.core.aggregation.MeanOfUploads` (the mixin refuses subclasses that aggregate otherwise).
The algorithm knows nothing of DP: `ClientDPAggregation` is the round's aggregation the round loop
is handed from outside (`Simulation(start_aggregation=...)`, wired by `pfedkit.build`) in place of
the algorithm's own `start_aggregation`.

Bit-exactness: an update inside the ball (||Delta_i|| <= C) is used as the client uploaded it
(w_i itself, not w0 + Delta_i), the uniform shares are summed in client order like the non-private
mean, and noise with z = 0 is not drawn; so z = 0 with a clip nothing reaches equals the
non-private run with equal n_i bit for bit (tests/test_privacy.py).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pfedkit.core.aggregation import MeanOfUploads, SampleWeightedMean
from pfedkit.core.params import Params
from pfedkit.core.seeds import SERVER, torch_generator

NOISE_PURPOSE = "dp-client-noise"  # the generator tag: (seed, round, SERVER, this)


@dataclass(frozen=True)
class ClientDP:
    """The run's client-level DP settings."""
    clip: float
    noise_multiplier: float
    seed: int
    # participants=poisson: q N, the fixed denominator; None: the round's m (fixed-size sampling)
    expected_participants: float | None = None


def update_norm(params: Params, reference: Params) -> float:
    """||params - reference||_2 over all entries, accumulated in float64."""
    return math.sqrt(sum(float(((params[name].double() - reference[name].double()) ** 2).sum())
                         for name in reference))


def clip_factor(norm: float, clip: float) -> float:
    """min(1, C / ||Delta||); the 1e-6 (as Opacus does) keeps a clipped norm below C in float32."""
    return 1.0 if norm <= clip else clip / (norm + 1e-6)


def clipped_model(params: Params, reference: Params, clip: float) -> tuple[Params, float]:
    """(w0 + clip(w - w0), ||w - w0||): the upload with its update clipped to norm `clip`. An update
    already inside the ball is returned as uploaded (no rounding through w0 + (w - w0))."""
    norm = update_norm(params, reference)
    factor = clip_factor(norm, clip)
    if factor == 1.0:
        return params, norm
    return {name: reference[name] + factor * (params[name] - reference[name]) for name in reference}, norm


def noise_std(noise_multiplier: float, clip: float, sampled: float) -> float:
    """z C / m: the Gaussian mechanism's std for a sum of updates of norm <= C divided by m (the
    round's sample size, or q N under Poisson sampling)."""
    return noise_multiplier * clip / sampled


def add_noise(mean: Params, std: float, generator: torch.Generator) -> Params:
    """mean + N(0, std^2 I), entry by entry in the dictionary's order (float32 on the host)."""
    return {name: value + std * torch.randn(value.shape, generator=generator, dtype=value.dtype)
            for name, value in mean.items()}


class ClientDPMean:
    """The round's aggregation under client-level DP: clip each reply's update against the broadcast
    `reference`, average uniformly over the `cids` sampled, add the noise. Same protocol as
    `SampleWeightedMean` (add / finish), and folds in client order through it with weights 1."""

    def __init__(self, key: str, cids: list[int], reference: Params | None, result: Callable[[Params], Any],
                 empty: Any, settings: ClientDP, rnd: int, record: Callable[[int, str, Any], None]) -> None:
        self.key, self.cids, self.reference, self.result, self.empty = key, list(cids), reference, result, empty
        self.settings, self.rnd, self.record = settings, rnd, record
        self.uniform = SampleWeightedMean(key, {cid: 1.0 for cid in self.cids}, lambda mean: mean, None)
        self.norms: dict[int, float] = {}

    def add(self, cid: int, reply: dict) -> None:
        upload = reply[self.key]
        if set(upload) != set(self.reference):
            raise ValueError(f"client-level DP: client {cid} uploaded {sorted(upload)[:3]}..., not the broadcast "
                             f"model's entries {sorted(self.reference)[:3]}...")
        clipped, self.norms[cid] = clipped_model(upload, self.reference, self.settings.clip)
        self.uniform.add(cid, {self.key: clipped, "weight": 1.0})

    def finish(self) -> Any:
        expected = self.settings.expected_participants
        if not self.cids and expected is None:
            return self.empty
        for cid in self.cids:
            if cid not in self.norms:  # sampled but never replied: a zero update (w0), denominator stays m
                self.uniform.add(cid, {self.key: self.reference, "weight": 1.0})
        if expected is None:
            mean, denominator = self.uniform.finish(), len(self.cids)
        else:  # Poisson: w0 + (sum of clipped updates) / (q N) = w0 + (m / qN) (uniform mean - w0)
            mean, denominator = self.reference, expected
            if self.cids:
                share = len(self.cids) / expected
                mean = {name: self.reference[name] + share * (value - self.reference[name])
                        for name, value in self.uniform.finish().items()}
        std = noise_std(self.settings.noise_multiplier, self.settings.clip, denominator)
        if std > 0:
            mean = add_noise(mean, std, torch_generator(self.settings.seed, self.rnd, SERVER, NOISE_PURPOSE))
        norms = [self.norms[cid] for cid in sorted(self.norms)]
        self.record(self.rnd, "dp_update_norm_median", float(torch.tensor(norms).median()) if norms else math.nan)
        self.record(self.rnd, "dp_clipped_fraction",
                    sum(n > self.settings.clip for n in norms) / len(norms) if norms else math.nan)
        return self.result(mean)


@dataclass(frozen=True)
class ClientDPAggregation:
    """A `StartAggregation` (`pfedkit.core.aggregation`): each round, the clipped, noised mean of the
    uploads into the algorithm's `averaged` server key, the reference being the broadcast model
    (server[averaged] before the round). Given to the round loop instead of the algorithm's own
    `start_aggregation`, which computes the same key's non-private, n_i-weighted mean."""
    settings: ClientDP
    algorithm: MeanOfUploads

    def __call__(self, rnd: int, server: Any, cids: list[int]) -> ClientDPMean:
        key = self.algorithm.averaged
        reference = server[key] if server is not None else None
        return ClientDPMean("params", cids, reference, lambda mean: {key: mean}, server, self.settings, rnd,
                            self.algorithm.record)
