"""Every random number comes from a generator seeded by (seed, round, client, purpose).

Nothing reads or writes torch's or numpy's global random state, so results do not depend on the
order in which clients are processed, on the runtime, or on how many workers there are.
"""
from __future__ import annotations

import zlib

import numpy as np
import torch

SERVER = -1  # the `client` slot for server-side randomness


def derive_seed(seed: int, rnd: int, client: int, purpose: str) -> int:
    """A 63-bit seed unique to (seed, round, client, purpose)."""
    entropy = [int(seed) & 0xFFFFFFFF, int(rnd), int(client) + 1, zlib.crc32(purpose.encode())]
    return int(np.random.SeedSequence(entropy).generate_state(2, dtype=np.uint32).view(np.uint64)[0] >> 1)


def numpy_rng(seed: int, rnd: int, client: int, purpose: str) -> np.random.Generator:
    return np.random.default_rng(derive_seed(seed, rnd, client, purpose))


def torch_generator(seed: int, rnd: int, client: int, purpose: str) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(seed, rnd, client, purpose))


SAMPLING_MODES = ("round", "floor", "poisson")


def sample_count(num_clients: int, join_ratio: float, rounding: str = "round") -> int:
    """m, the clients a fixed-size round samples: round(join_ratio * N), or int(join_ratio * N) with
    rounding="floor" (PFLlib), at least 1 and at most N."""
    if rounding not in ("round", "floor"):
        raise ValueError(f"rounding must be 'round' or 'floor', got {rounding!r}")
    scaled = join_ratio * num_clients
    return min(num_clients, max(1, int(scaled) if rounding == "floor" else int(round(scaled))))


def sample_clients(seed: int, rnd: int, num_clients: int, join_ratio: float,
                   rounding: str = "round") -> list[int]:
    """The round's participants, sorted: `sample_count` clients drawn without replacement
    ("round", "floor"), or with rounding="poisson" each client independently with probability
    join_ratio (the count varies from round to round and may be 0: Poisson sampling, which is what
    the Poisson privacy accountants analyse; docs/privacy.md)."""
    if rounding not in SAMPLING_MODES:
        raise ValueError(f"rounding must be one of {SAMPLING_MODES}, got {rounding!r}")
    rng = numpy_rng(seed, rnd, SERVER, "client-sampling")
    if rounding == "poisson":
        return [int(c) for c in np.flatnonzero(rng.random(num_clients) < join_ratio)]
    count = sample_count(num_clients, join_ratio, rounding)
    if count >= num_clients:
        return list(range(num_clients))
    chosen = rng.choice(num_clients, size=count, replace=False)
    return sorted(int(c) for c in chosen)


def round_participants(seed: int, rnd: int, pool: list[int], join_ratio: float, rounding: str = "round") -> list[int]:
    """The clients of `pool` (the training clients, in order) sampled in round `rnd`: the one draw
    the round loop and the privacy accountant both use."""
    return [pool[k] for k in sample_clients(seed, rnd, len(pool), join_ratio, rounding)]
