"""Math on parameter dictionaries (`Params = dict[name, Tensor]`), shared by every algorithm.

Parameter names start with `body.` or `head.` (every model is body + head), so selecting a part
is a prefix filter. These helpers never modify their inputs.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

Params = dict[str, torch.Tensor]


def select(params: Params, part: str) -> Params:
    """The `body` or `head` subset of `params` (`all` returns every entry)."""
    if part == "all":
        return dict(params)
    if part not in ("body", "head"):
        raise ValueError(f"part must be 'all', 'body' or 'head', got {part!r}")
    prefix = part + "."
    return {name: value for name, value in params.items() if name.startswith(prefix)}


def unprefixed(params: Params, part: str) -> Params:
    """The `body` or `head` entries keyed as inside that submodule (`body.conv1.weight` ->
    `conv1.weight`): the state for `functional_call(model.body, ...)`."""
    prefix = part + "."
    return {name[len(prefix):]: value for name, value in params.items() if name.startswith(prefix)}


def linear_layer_names(params: Params, prefix: str) -> tuple[str, str | None]:
    """(weight name, bias name or None) of the one Linear layer stored under `prefix.` (a 2-d
    `.weight` and at most a 1-d `.bias`, nothing else); ValueError naming what is there otherwise."""
    part = [name for name in params if name.startswith(prefix + ".")]
    weights = [n for n in part if n.endswith(".weight") and params[n].dim() == 2]
    biases = [n for n in part if n.endswith(".bias") and params[n].dim() == 1]
    if len(weights) != 1 or len(biases) > 1 or len(part) != len(weights) + len(biases):
        raise ValueError(f"expected one Linear layer (a weight and optionally a bias) under {prefix!r}, got {sorted(part)}")
    return weights[0], (biases[0] if biases else None)


def merge(*parts: Params) -> Params:
    """Union of parameter subsets; later ones win on a shared name."""
    merged: Params = {}
    for part in parts:
        merged.update(part)
    return merged


def clone(params: Params) -> Params:
    return {name: value.detach().clone() for name, value in params.items()}


def mean_shares(weights: Iterable[float]) -> list[float]:
    """a_j / sum_k a_k for each weight (the sum taken in the given order)."""
    weights = [float(w) for w in weights]
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"weighted_mean: weights must sum to a positive number, got {weights}")
    return [w / total for w in weights]


class WeightedSum:
    """sum_j s_j w_j over parameter sets added one at a time: entry by entry, in the order added
    (so a running sum equals the sum over a list in that order, bit for bit)."""

    def __init__(self) -> None:
        self.total: Params | None = None

    def add(self, params: Params, share: float) -> None:
        if self.total is None:
            self.total = {name: torch.zeros_like(value) for name, value in params.items()}
        for name, acc in self.total.items():
            acc.add_(params[name], alpha=share)


def weighted_mean(params_list: Sequence[Params], weights: Iterable[float]) -> Params:
    """WMean({w_j}, {a_j}) = sum_j a_j w_j / sum_j a_j, entry by entry (float64 weights)."""
    weights = list(weights)
    if len(weights) != len(params_list) or not params_list:
        raise ValueError("weighted_mean needs one weight per parameter set and at least one set")
    running = WeightedSum()
    for share, params in zip(mean_shares(weights), params_list):
        running.add(params, share)
    return running.total


def interpolate(a: Params, b: Params, t: float) -> Params:
    """(1 - t) a + t b, entry by entry over the names of `a` (t = 0 gives `a`, t = 1 gives `b`)."""
    t = float(t)
    return weighted_mean([a, b], [1.0 - t, t])


def squared_distance(a: Params, b: Params) -> torch.Tensor:
    """sum over shared entries of ||a - b||^2 (differentiable in `a`)."""
    return sum(((a[name] - b[name]) ** 2).sum() for name in b)


def squared_distance_f64(a: Params, b: Params) -> float:
    """sum over the entries of `a` of ||a - b||^2, accumulated in float64 (for server-side
    decisions on model distances: FedAMP's attention, FeSEM's E-step)."""
    return float(sum(((a[name].double() - b[name].double()) ** 2).sum() for name in a))


def flatten(params: Params) -> torch.Tensor:
    """One 1-D vector of all entries, in the dictionary's order."""
    return torch.cat([value.reshape(-1) for value in params.values()])
