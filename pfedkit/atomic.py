"""Atomic file writes: write to a temporary file beside the target, then rename over it.

A run killed mid-write leaves either the old file or the new one, never half of one, which is
what makes `pfedkit run --resume` safe. What a kill -9 does leave is the temporary file,
`.NAME.PID.tmp`; `remove_stale_temporaries` (called by resume) removes those of processes that
are gone. The temporary file is created new (O_EXCL) and never through a symbolic link
(O_NOFOLLOW): a link planted under that name in a shared folder is replaced, not written through.
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
        with open(_new_file(tmp), "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def _new_file(path: Path) -> int:
    """A file descriptor of `path` created afresh for writing: whatever was there (a stale
    temporary file of a killed process with this PID, a symbolic link) is removed first, and
    the creation itself refuses to follow a link or to open an existing file."""
    path.unlink(missing_ok=True)  # a link is removed itself, its target is not touched
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)


def remove_stale_temporaries(folder: str | Path) -> list[Path]:
    """Remove the `.NAME.PID.tmp` files in `folder` that `atomic_write` calls of processes no
    longer running left behind (a kill -9 mid-write); returns them. Files of a live process
    (another run writing there) are kept."""
    removed = []
    for path in Path(folder).glob(".*.*.tmp"):
        pid = path.name.rsplit(".", 2)[-2]
        if pid.isdigit() and not _process_exists(int(pid)):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _process_exists(pid: int) -> bool:
    if os.name == "nt":  # os.kill would terminate the process there: keep the file
        return True
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except (ProcessLookupError, OverflowError):  # gone, or no process id at all
        return False
    except PermissionError:  # another user's process
        return True
    return True


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
