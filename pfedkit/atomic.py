"""Atomic file writes: write to a temporary file beside the target, then rename over it.

A run killed mid-write leaves either the old file or the new one, never half of one, which is
what makes `pfedkit run --resume` safe.
"""
from __future__ import annotations

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
