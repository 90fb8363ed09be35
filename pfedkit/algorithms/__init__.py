"""Algorithms: one small module each, registered by name with `@register`.

Every module of this package is imported on first lookup (`algorithm_names`, `get_algorithm`) so
that its algorithms register themselves; a new algorithm is a new file, and so is a module of
math that several methods share (it registers nothing). Importing the package alone imports no
algorithm. The contract every algorithm follows is `pfedkit.core.contract`.
"""
from __future__ import annotations

import importlib
import pkgutil

from pfedkit.algorithms.registry import registry
from pfedkit.core.contract import Algorithm

_loaded = False


def _load_all() -> None:
    global _loaded
    if _loaded:
        return
    for module in pkgutil.iter_modules(__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")
    _loaded = True


def algorithm_names() -> list[str]:
    _load_all()
    return sorted(registry())


def get_algorithm(name: str) -> type[Algorithm]:
    _load_all()
    if name not in registry():
        raise ValueError(f"unknown algorithm {name!r}; allowed: {', '.join(algorithm_names())}")
    return registry()[name]
