"""pfedkit: personalized federated learning under label skew and class imbalance.

    import pfedkit
    result = pfedkit.run({"algorithm": "fedavg", "dataset": "digits", "rounds": 5})
    result.summary["final_acc"], result.metrics.head()
"""
from __future__ import annotations

__version__ = "0.1.0"


def run(config=None, overrides=None, *, resume=None, quiet=True):
    """See `pfedkit.runs.run`."""
    from pfedkit.runs import run as _run

    return _run(config, overrides, resume=resume, quiet=quiet)


__all__ = ["run", "__version__"]
