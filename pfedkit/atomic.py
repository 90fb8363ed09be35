"""Atomic file writes: write to a temporary file beside the target, then rename over it.

A run killed mid-write leaves either the old file or the new one, never half of one, which is
what makes `pfedkit run --resume` safe.
"""
from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: str | Path, payload: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_torch_save(path: str | Path, obj: Any) -> None:
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def atomic_savez(path: str | Path, **arrays: Any) -> None:
    import numpy as np

    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    atomic_write_bytes(path, buffer.getvalue())
