"""Algorithms: one small module each, registered by name with `@register`.

Every module of this package is imported here so that its algorithms register themselves; a new
algorithm is a new file. See `base.py` for the contract every algorithm follows.
"""
from __future__ import annotations

import importlib
import pkgutil

from pfedkit.algorithms.base import Algorithm, registry

_HELPER_MODULES = {"base", "params"}

for _module in pkgutil.iter_modules(__path__):
    if _module.name not in _HELPER_MODULES and not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")


def algorithm_names() -> list[str]:
    return sorted(registry())


def get_algorithm(name: str) -> type[Algorithm]:
    if name not in registry():
        raise ValueError(f"unknown algorithm {name!r}; allowed: {', '.join(algorithm_names())}")
    return registry()[name]
