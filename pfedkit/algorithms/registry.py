"""The algorithms by name: `@register` on each algorithm class, `registry()` for the lookup."""
from __future__ import annotations

from pfedkit.core.contract import EVALUATED_MODELS, Algorithm

_REGISTRY: dict[str, type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: make an algorithm available by its `name`."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"algorithm name {cls.name!r} registered twice")
    if cls.evaluated_model is not None and cls.evaluated_model not in EVALUATED_MODELS:
        raise ValueError(f"{cls.__name__}.evaluated_model = {cls.evaluated_model!r}; allowed: "
                         f"{', '.join(EVALUATED_MODELS)} (core.contract.EvaluatedModel)")
    _REGISTRY[cls.name] = cls
    return cls


def registry() -> dict[str, type[Algorithm]]:
    return _REGISTRY

