"""The noise a privacy budget allows: the smallest noise multiplier whose epsilon stays within a target.

epsilon falls as the noise multiplier z grows (for a fixed sampling, number of steps and delta),
so a bisection on z finds the smallest z whose epsilon is <= the target. `epsilon_at` is any
accountant reading of z: `accounting.epsilon` for one mechanism, or a `PrivacyBudget` built with z
and read on a run's rows (the exact schedule of an earlier run with the same seed).
"""
from __future__ import annotations

import math
from collections.abc import Callable


def noise_for_epsilon(epsilon_at: Callable[[float], float], target: float, *, low: float = 1e-2,
                      high: float = 1e3, rel_tol: float = 1e-4) -> float:
    """The smallest noise multiplier z in [low, high] (to `rel_tol`) with epsilon_at(z) <= target."""
    if not target > 0:
        raise ValueError(f"target epsilon must be > 0, got {target}")
    if epsilon_at(high) > target:
        raise ValueError(f"epsilon {target:g} is out of reach: noise multiplier {high:g} still gives "
                         f"{epsilon_at(high):.4g}")
    if epsilon_at(low) <= target:
        return low
    while high / low > 1 + rel_tol:
        middle = math.sqrt(low * high)  # geometric: z spans decades
        if epsilon_at(middle) <= target:
            high = middle
        else:
            low = middle
    return high
