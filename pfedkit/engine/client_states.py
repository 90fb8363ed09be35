"""Where the clients' states live: in memory (a list) or on disk (one file per client).

Local, Ditto or FedPer keep a model per client: 1,000 clients of FedAvgCNN hold 2.3 GB, 10,000
clients 23 GB. With `client_states=disk` each state is a file read when the round loop asks
for it and written when a new one replaces it, so memory holds only the clients being trained
or evaluated at the moment (`DISK_WINDOW` at a time). `auto` (the default) chooses disk when
the states would take more than half of the memory this machine has available.

A write never changes a file: it makes a new one and deletes the old one unless the last
checkpoint names it. A checkpoint therefore holds only the file names (`DiskStates` is stored
as its names), those files stay until the next checkpoint has landed, and a resumed run reads
its states from the directory as the checkpoint left it, whatever happened after.

The files sit in the run directory, which travels, so they are data like the checkpoint
(pfedkit/run_files.py: plain-data `torch.save` files read with `weights_only=True`, never
unpickled), and a checkpoint names only files of the pattern `{prefix}-{cid}.{version}.pt` in
the states' directory: a crafted checkpoint can point neither at a pickle nor outside.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pfedkit.core.contract import message_bytes
from pfedkit.core.errors import ConfigError
from pfedkit.run_files import RESUME_FIX, RunFileError, check_data_file, dump_data, read_data

DISK_WINDOW = 128  # clients whose states are in memory together while a round trains them from disk
AUTO_DISK_FRACTION = 0.5  # auto: disk when the states would take more than this share of available memory
STATES_DIR = "client_states"  # inside a run directory
PREFIXES = ("client", "optimizer")  # DiskStates of client states and of optimizer states


class DiskStates:
    """A list of per-client objects kept as files in `directory` (`{prefix}-{cid}.{version}.pt`):
    `states[cid]` reads client cid's object, `states[cid] = value` writes a new one. The files are
    plain-data `.pt` files (run_files: tensors with their exact values and strides)."""

    def __init__(self, directory: str | Path, prefix: str, values: Iterable[Any], scratch: Any = None) -> None:
        """`scratch`: the TemporaryDirectory that `directory` is, kept alive (and deleted) with this store."""
        self.prefix, self.names, self.version, self.pinned, self.unsynced = prefix, [], 0, set(), set()
        self.directory, self._scratch = Path(directory), scratch
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(f"{prefix}-*.pt"):  # left by a run killed before its first checkpoint
            stale.unlink()
        for value in values:
            self.names.append(None)
            self[len(self.names) - 1] = value

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, cid: int) -> Any:
        return read_data(self.directory / self.names[self._index(cid)], f"state of client {cid}", RESUME_FIX)

    def __setitem__(self, cid: int, value: Any) -> None:
        cid = self._index(cid)
        self.version += 1
        name = f"{self.prefix}-{cid}.{self.version}.pt"
        with open(self.directory / name, "wb") as handle:
            dump_data(value, handle)
        old, self.names[cid] = self.names[cid], name
        self.unsynced.add(name)
        if old is not None and old not in self.pinned:
            self._delete(old)

    def __iter__(self) -> Iterator[Any]:
        return (self[cid] for cid in range(len(self)))

    def _index(self, cid: int) -> int:
        if not 0 <= cid < len(self.names):
            raise IndexError(f"client {cid}: there are {len(self.names)} client states")
        return cid

    def _delete(self, name: str) -> None:
        self.unsynced.discard(name)
        (self.directory / name).unlink(missing_ok=True)

    # ---- checkpoints ------------------------------------------------------------------------

    def sync(self) -> None:
        """Make the files written since the last checkpoint durable (before a checkpoint names them)."""
        for name in sorted(self.unsynced):
            with open(self.directory / name, "rb") as handle:
                os.fsync(handle.fileno())
        self.unsynced.clear()

    def pin(self) -> None:
        """A checkpoint naming the current files has landed: those are kept from now on, and the
        ones only the previous checkpoint named are deleted."""
        current = set(self.names)
        for name in self.pinned - current:
            self._delete(name)
        self.pinned = current

    def __getstate__(self) -> dict[str, Any]:
        return {"prefix": self.prefix, "names": list(self.names), "version": self.version}

    def __setstate__(self, saved: dict[str, Any]) -> None:
        """From a checkpoint: ValueError unless it names files of this store's own pattern."""
        prefix, names, version = saved["prefix"], saved["names"], saved["version"]
        if prefix not in PREFIXES or type(names) is not list or type(version) is not int:
            raise ValueError(f"client state files named as {prefix!r}, {type(names).__name__}, "
                             f"{type(version).__name__} (expected one of {PREFIXES}, a list, a number)")
        pattern = re.compile(rf"{prefix}-(\d+)\.(\d+)\.pt")
        for cid, name in enumerate(names):
            named = pattern.fullmatch(name) if isinstance(name, str) else None
            if named is None or int(named[1]) != cid or int(named[2]) > version:
                raise ValueError(f"client {cid}'s state file is named {name!r}, not {prefix}-{cid}.N.pt")
        self.prefix, self.names, self.version = prefix, names, version
        self.pinned, self.unsynced, self._scratch, self.directory = set(names), set(), None, None

    def reopen(self, directory: str | Path) -> None:
        """After reading a checkpoint: read from `directory`, deleting the files written after
        that checkpoint (a run killed mid-round wrote some of the next states). RunFileError,
        with nothing deleted, when a file the checkpoint names is missing or damaged."""
        self.directory = Path(directory)
        missing = [name for name in self.names if not (self.directory / name).is_file()]
        if missing:
            raise RunFileError(f"{self.directory}: the checkpoint names {len(missing)} client state file(s) that "
                               f"are not there (e.g. {missing[0]}); {RESUME_FIX}")
        for name in self.names:  # a truncated or empty file is refused now, not rounds later
            check_data_file(self.directory / name, "client state file", RESUME_FIX)
        for path in self.directory.glob(f"{self.prefix}-*.pt"):
            if path.name not in self.pinned:
                path.unlink()


def scratch_directory(parent: str | Path) -> tempfile.TemporaryDirectory:
    """A directory for the states of a run that has no run directory (`pfedkit bench`, a
    library call of `prepare`), under `parent` rather than the system's temporary directory,
    which may be memory (tmpfs); deleted when the stores using it are."""
    Path(parent).mkdir(parents=True, exist_ok=True)
    return tempfile.TemporaryDirectory(prefix=f".{STATES_DIR}-", dir=parent)


@dataclass(frozen=True)
class Placement:
    """Where a simulation keeps its client states: `mode` auto | memory | disk; `directory`: the
    files' directory (None: a scratch directory under `scratch_parent`, deleted afterwards)."""
    mode: str = "memory"
    directory: str | Path | None = None
    scratch_parent: str | Path = "."

    def place(self, first: Any, rest: Iterable[Any], clients: int, keep_optimizer_state: bool) -> tuple[Any, Any]:
        """(client states, optimizer states): lists or `DiskStates`, from the first client's state
        (measured to decide) and the others' (built one at a time, never all held when on disk)."""
        per_client = message_bytes(first)
        values = itertools.chain([first], rest)
        if choose_placement(self.mode, per_client, clients, available_memory()) == "memory":
            return list(values), [{} for _ in range(clients)] if keep_optimizer_state else []
        directory, scratch = self.directory, None
        if directory is None:
            scratch = scratch_directory(self.scratch_parent)
            directory = scratch.name
        check_disk_space(directory, per_client, clients)
        optimizer = ([] if not keep_optimizer_state else
                     DiskStates(directory, "optimizer", ({} for _ in range(clients)), scratch))
        return DiskStates(directory, "client", values, scratch), optimizer


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux MemAvailable); None where unknown."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def disk_stores(state: Any) -> list[DiskStates]:
    """The `DiskStates` among a SimState's per-client lists."""
    return [values for values in (state.clients, state.optimizer_states) if isinstance(values, DiskStates)]


def choose_placement(mode: str, per_client: int, clients: int, available: int | None) -> str:
    """'memory' or 'disk' for `clients` states of `per_client` bytes; `available`: memory
    available (bytes, None where unknown). Refuses memory placement that cannot fit."""
    needed = per_client * clients
    if mode == "auto":
        mode = "disk" if available is not None and needed > AUTO_DISK_FRACTION * available else "memory"
    if mode == "memory" and available is not None and needed > 0.9 * available:
        raise ConfigError(f"num_clients={clients}: the algorithm keeps {per_client / 2**20:.1f} MB per client, "
                          f"{needed / 2**30:.1f} GB in all, and this machine has {available / 2**30:.1f} GB "
                          "available; use client_states=disk (or auto), fewer clients, a smaller model, or an "
                          "algorithm that keeps less per client")
    return mode


def check_disk_space(directory: str | Path, per_client: int, clients: int) -> None:
    """Refuse disk placement where the states cannot be written twice (a checkpoint's files are
    kept until the next checkpoint lands)."""
    where = Path(directory)
    while not where.exists():
        where = where.parent
    free, needed = shutil.disk_usage(where).free, 2 * per_client * clients
    if needed > free:
        raise ConfigError(f"client_states=disk: {clients} client states need up to {needed / 2**30:.1f} GB on disk "
                          f"and {where.resolve()} has {free / 2**30:.1f} GB free; free some space or use fewer clients")
