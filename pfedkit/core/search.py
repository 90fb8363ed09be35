"""Search ranges declared on an algorithm's options, for `pfedkit tune`.

A method's tuned options carry their range where the option is declared, on its `Hyper` field:

    mu: float = Field(0.01, ge=0, description="...", json_schema_extra=float_range(1e-4, 1.0, log=True))

Why on the field and not in a table (or a `search_space` class attribute): the range sits next to
the default and the bounds it must agree with (a test checks that each range holds its option's
default and that the config accepts both ends), it follows the option into subclasses (R-pFedPM
tunes pFedPM's `a` and `lam`; the three prototype methods share `lam`'s), and a new method brings its
search space in its own file. The format is `pfedkit tune`'s parameter spec (docs/tuning.md), as
plain data: `experiments/tuning.py` validates it, as it validates a `--space` file.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel

SEARCH = "search"  # the key of a field's json_schema_extra that holds its range


def float_range(low: float, high: float, *, log: bool = False, step: float | None = None) -> dict[str, Any]:
    """A real-valued option searched in [low, high] (log: on a log scale)."""
    return _searched({"type": "float", "low": low, "high": high, "log": log, "step": step})


def int_range(low: int, high: int, *, log: bool = False, step: int | None = None) -> dict[str, Any]:
    """An integer option searched in low..high (both included)."""
    return _searched({"type": "int", "low": low, "high": high, "log": log, "step": step})


def choices(*values: Any) -> dict[str, Any]:
    """An option searched among `values`."""
    return _searched({"type": "categorical", "choices": list(values)})


def _searched(spec: dict[str, Any]) -> dict[str, Any]:
    """A field's `json_schema_extra` holding `spec` (unset keys left out, as a YAML spec writes them)."""
    return {SEARCH: {key: value for key, value in spec.items() if value is not None and value is not False}}


def declared_ranges(hyper: type[BaseModel]) -> dict[str, dict[str, Any]]:
    """{option: its range spec} for the options of `hyper` (a `Hyper` class) that declare one."""
    ranges = {}
    for name, field in hyper.model_fields.items():
        extra = field.json_schema_extra
        if isinstance(extra, dict) and SEARCH in extra:
            ranges[name] = dict(extra[SEARCH])
    return ranges


def range_in_words(spec: dict[str, Any]) -> str:
    """A range as `pfedkit list` shows it: "[0.0001, 1] log", "1..10", "{1, 2}"."""
    if spec["type"] == "categorical":
        return "{" + ", ".join(f"{value:g}" if isinstance(value, float) else str(value)
                               for value in spec["choices"]) + "}"
    low, high = spec["low"], spec["high"]
    words = f"{low}..{high}" if spec["type"] == "int" else f"[{low:g}, {high:g}]"
    return words + (" log" if spec.get("log") else "") + (f" step {spec['step']:g}" if spec.get("step") else "")
