"""Where a command writes: checked before it creates anything, so a refused command leaves nothing
behind (one-line ConfigErrors naming the option and the path). Used by the command line and the
Flower commands."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from pfedkit.core.errors import ConfigError


def check_writable_dir(path: Path, what: str, given: Path | None = None, fix: str | None = None) -> None:
    """ConfigError naming `what` and the path the user `given` (default: `path`) unless `path` is
    a folder this process can write into, or can be created as one. Checked before a command
    creates anything, so a refused command leaves nothing behind."""
    path = path.absolute()
    shown = (given or path).absolute()
    fix = fix or f"choose another {what}"
    existing = nearest_existing(path, what, shown, fix)
    if not existing.is_dir():
        raise ConfigError(f"{what} {shown}: {existing} is a file, not a folder; {fix}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {shown}: {existing} is not writable (permissions or a read-only file system); {fix}")
    try:  # permission bits are not the whole story: /proc, or root on a file system that refuses
        os.rmdir(tempfile.mkdtemp(prefix=".pfedkit-probe-", dir=existing))
    except OSError as err:
        raise ConfigError(f"{what} {shown}: no folder can be made in {existing} ({err.strerror}); {fix}") from None


def nearest_existing(path: Path, what: str, shown: Path, fix: str) -> Path:
    """The nearest of `path` and its parents that exists (the root always does); ConfigError when
    a symbolic link on the way leads nowhere (a loop, or a missing target): nothing can be made
    behind it."""
    for part in (path, *path.parents):
        if part.exists():
            return part
        if part.is_symlink():
            raise ConfigError(f"{what} {shown}: {part} is a symbolic link leading nowhere (a loop or a missing "
                              f"target); {fix}")
    return Path(path.anchor)


def check_writable_file(path: Path, what: str) -> None:
    """As `check_writable_dir`, for a file to be written (its folder must be writable)."""
    if path.is_dir():
        raise ConfigError(f"{what} {path.absolute()}: is a folder; expected a file path such as {path / 'stats.png'}")
    check_writable_dir(path.parent, what, given=path)
