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


def sample_clients(seed: int, rnd: int, num_clients: int, join_ratio: float,
                   rounding: str = "round") -> list[int]:
    """The round's participants, sorted: round(join_ratio * N) clients, or int(join_ratio * N)
    with rounding="floor" (PFLlib), at least 1."""
    if rounding not in ("round", "floor"):
        raise ValueError(f"rounding must be 'round' or 'floor', got {rounding!r}")
    scaled = join_ratio * num_clients
    count = max(1, int(scaled) if rounding == "floor" else int(round(scaled)))
    if count >= num_clients:
        return list(range(num_clients))
    chosen = numpy_rng(seed, rnd, SERVER, "client-sampling").choice(num_clients, size=count, replace=False)
    return sorted(int(c) for c in chosen)
