"""How many threads this process computes with, set for one piece of work at a time.

The round loop and the runtimes use these; an algorithm never sets threads itself (the engine runs
all its code under the run's count, so kernels, and hence numbers, do not depend on the backend).
"""
from __future__ import annotations

import contextlib
import sys

import torch


@contextlib.contextmanager
def thread_count(threads: int | None):
    """torch's thread count is process-wide: set it for one runtime call only (None: unchanged).

    A runtime that sets it inside `fit_stream` restores it before each `yield`: the caller's
    code between results (client updates, aggregation) runs at the run's count (`compute_threads`)."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def resolved_threads(threads: int | None) -> int:
    """A runtime's `threads` as a number: None means this process's torch count now (all cores
    unless someone changed it)."""
    return int(threads) if threads else torch.get_num_threads()


class _NativePools:
    """threadpoolctl's view of the BLAS and OpenMP libraries loaded in this process.

    Scanning the loaded libraries costs ~3 ms, so the scan is kept and redone only when modules
    were imported since (a new BLAS, e.g. scipy's, arrives with an import)."""

    def __init__(self) -> None:
        self.controller = None
        self.modules_seen = -1

    def limit(self, threads: int):
        from threadpoolctl import ThreadpoolController

        if self.controller is None or len(sys.modules) != self.modules_seen:
            self.controller, self.modules_seen = ThreadpoolController(), len(sys.modules)
        return self.controller.limit(limits=threads)


_NATIVE_POOLS = _NativePools()


@contextlib.contextmanager
def compute_threads(threads: int):
    """Run the enclosed computation with `threads` threads everywhere this process computes:
    torch's intra-op pool and the BLAS/OpenMP pools torch's setting does not reach (numpy's and
    scipy's OpenBLAS: FedPAC's eigh and NNLS, CFL's clustering), through threadpoolctl.

    The round loop runs every piece of algorithm code (server and client side) and the runtimes'
    work in this process under the run's count, so kernels (oneDNN, MKL, OpenBLAS pick their
    blocking by thread count) and hence numbers do not depend on the backend."""
    with thread_count(threads), _NATIVE_POOLS.limit(threads):
        yield
