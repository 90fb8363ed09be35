"""Atomic file writes: write to a temporary file beside the target, then rename over it.

A run killed mid-write leaves either the old file or the new one, never half of one, which is
what makes `pfedkit run --resume` safe.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO


def atomic_write(path: str | Path, write: Callable[[BinaryIO], Any]) -> None:
    """`write(handle)` into a temporary file beside `path`, made durable, then renamed over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def atomic_write_bytes(path: str | Path, payload: bytes) -> None:
    atomic_write(path, lambda handle: handle.write(payload))


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_torch_save(path: str | Path, obj: Any) -> None:
    """torch.save straight into the file: a checkpoint of every client's model is not copied
    into memory first."""
    import torch

    atomic_write(path, lambda handle: torch.save(obj, handle))


def atomic_savez(path: str | Path, **arrays: Any) -> None:
    import numpy as np

    atomic_write(path, lambda handle: np.savez_compressed(handle, **arrays))


def json_ready(value: Any) -> Any:
    """`value` with every NaN or infinite float replaced by None (JSON's null), in nested dicts,
    lists and tuples: Python writes NaN as a bare `NaN`, which strict parsers (JavaScript, jq,
    Go, Rust's serde) refuse."""
    if isinstance(value, float):  # numpy's float64 too
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(item) for item in value]
    return value


def strict_json(value: Any, indent: int | None = 2) -> str:
    """Strict JSON text of `value` (NaN and infinities as null); anything else JSON cannot hold
    raises instead of being written."""
    return json.dumps(json_ready(value), indent=indent, allow_nan=False)


def atomic_write_json(path: str | Path, value: Any) -> None:
    atomic_write_text(path, strict_json(value) + "\n")
