"""pfedkit: personalized federated learning under label skew and class imbalance.

    import pfedkit
    result = pfedkit.run({"algorithm": "fedavg", "dataset": "digits", "rounds": 5})
    result.summary["final_acc"], result.metrics.head()
"""
from __future__ import annotations

import os
import sys

__version__ = "0.1.0"


SPIN_BEFORE_SLEEP = "10000"  # libgomp's GOMP_SPINCOUNT on an idle machine: busy-wait iterations before sleeping


def openmp_waiting(load: float, cores: int) -> dict[str, str]:
    """How OpenMP threads should wait for work, given the machine's load and this process's cores.

    torch's OpenMP threads (libgomp) spin 300,000 iterations between parallel regions by default.
    Where other jobs hold the cores (a shared lab server), each region then waits for threads
    spinning off-core: the README's comparison took 140 s instead of 44 s under a load of 8 on 2
    cores (benchmarks/busy_machine.py, RESULTS.md). So a loaded machine (load >= cores) gets
    passive waiting; an idle one keeps a short spin (10,000 iterations), as fast as libgomp's
    default there (not spinning at all costs small models a third more: a wake-up per region).
    Waiting changes scheduling only, never a number."""
    return {"OMP_WAIT_POLICY": "PASSIVE"} if load >= cores else {"GOMP_SPINCOUNT": SPIN_BEFORE_SLEEP}


def _machine_load() -> float:
    """The 1-minute load average, or the processes runnable right now besides this one if more
    (a load that just started has not reached the average yet); 0 where neither can be read."""
    try:
        average = os.getloadavg()[0]
    except (AttributeError, OSError):
        average = 0.0
    try:
        with open("/proc/loadavg") as handle:
            running = int(handle.read().split()[3].split("/")[0]) - 1
    except (OSError, ValueError, IndexError):
        running = 0
    return max(average, float(running))


def _choose_openmp_waiting() -> None:
    """libgomp reads its settings once, when torch loads: so they are chosen here, before any
    pfedkit module imports torch. A user's OMP_WAIT_POLICY or GOMP_SPINCOUNT wins; a process that
    imported torch first keeps what it had. Worker processes inherit the choice."""
    if "torch" in sys.modules or {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ):
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ.update(openmp_waiting(_machine_load(), cores))


_choose_openmp_waiting()


def run(config=None, overrides=None, *, resume=None, quiet=True):
    """See `pfedkit.runs.run`."""
    from pfedkit.runs import run as _run

    return _run(config, overrides, resume=resume, quiet=quiet)


__all__ = ["run", "__version__"]
