"""What a run computes, as opposed to where and how fast it runs; and what changed between two.

A run's *identity* is its resolved config without the execution keys. Two configs with the same
identity give the same numbers (runs are identical across backends, worker and thread counts,
which the backend tests check), so a resumed run or a resumed comparison may change execution
keys but nothing else. This module sits on the ground floor (it imports only the config) because
both `runs.py` (resume) and `experiments/comparison.py` (reuse of finished runs) use it.
"""
from __future__ import annotations

import json
from functools import cache
from typing import Any

from pfedkit.config import Config

# Keys that say where or how fast a run executes, not what it computes.
EXECUTION_KEYS = ("out_dir", "name", "backend", "workers", "threads", "data_dir", "checkpoint_every", "ray", "flower",
                  "compile", "client_states", "vectorized")


def identity(config: Config) -> dict[str, Any]:
    """What a run computes: its resolved config (as config.yaml holds it) without the execution keys."""
    data = config.to_dict()
    for key in EXECUTION_KEYS:
        data.pop(key, None)
    return data


def flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections as dotted keys (`partition.alpha`), as a user writes them on the command line."""
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


MISSING = "(absent)"


def changed_keys(before: dict[str, Any], after: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (value before, value after)} for every key whose value differs, in key order.

    A key absent on one side equals the config's default for it: a run written before a key
    existed (new_clients, validation_fraction, ...) computed what that key's default computes, so
    it still resumes and is still reused."""
    old, new = flatten(before), flatten(after)
    changes = {}
    for key in sorted(old.keys() | new.keys()):
        was, now = old.get(key, MISSING), new.get(key, MISSING)
        if _canonical(_or_default(key, was)) != _canonical(_or_default(key, now)):
            changes[key] = (was, now)
    return changes


@cache
def _defaults() -> dict[str, Any]:
    return flatten(Config().to_dict())


def _or_default(key: str, value: Any) -> Any:
    return _defaults().get(key, MISSING) if value is MISSING else value


def describe_changes(changes: dict[str, tuple[Any, Any]]) -> str:
    """`lr: 0.05 -> 0.1, seed: 0 -> 1` (one line)."""
    return ", ".join(f"{key}: {_show(before)} -> {_show(after)}" for key, (before, after) in changes.items())


def _canonical(value: Any) -> str:
    # both sides come from validated configs (same types); JSON text compares lists and dicts too
    return json.dumps(value, sort_keys=True, default=str)


def _show(value: Any) -> str:
    return value if value is MISSING else json.dumps(value, default=str)
