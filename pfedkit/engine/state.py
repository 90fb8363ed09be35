"""A simulation's state between rounds: what the round loop updates, checkpoints and resumes from,
and what the clients side (`engine.protocols.Clients`) reads and writes; and its checkpoint file.

The checkpoint is data, not a pickle (pfedkit/run_files.py): `torch.load(weights_only=True)`
reads it, and only SimState and DiskStates are rebuilt from it as objects.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pfedkit.engine.client_states import DiskStates
from pfedkit.run_files import RESUME_FIX, RunFileError, read_data, write_data


@dataclass
class SimState:
    """Everything a resumed run needs; checkpointed after rounds."""
    round: int
    server: Any
    clients: list[Any]  # per client: a list, or DiskStates (client_states=disk)
    buffers: list[Any]  # per-client BatchNorm statistics (None for models without buffers)
    rows: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    # The first round each process runs (a run, a resume) pays one-off start-up: lazy imports (the
    # first optimiser imports torch._dynamo, 1-4 s), kernel warm-up, a pool's start. Its seconds are
    # also kept here, so that `seconds_per_round` measures the rounds after it.
    startup_seconds: float = 0.0
    startup_rounds: int = 0
    class_correct: np.ndarray | None = None
    class_total: np.ndarray | None = None
    head_row_norms: np.ndarray | None = None  # [N, C] at the last evaluation (nan: no Linear head)
    diagnostics: dict[str, dict[int, Any]] = field(default_factory=dict)  # what algorithms recorded
    # keep_optimizer_state: per client, {optimizer name: SGD momentum buffers by parameter name};
    # client-side memory, checkpointed, never sent; a list, or DiskStates like `clients`.
    optimizer_states: list[dict[str, Any]] = field(default_factory=list)

    def seconds_per_round(self) -> float:
        """Mean wall time of the rounds done after each process's first; all rounds' mean when
        every round was a first (a 1-round run)."""
        steady = self.round - self.startup_rounds
        if steady <= 0:
            return self.seconds / max(1, self.round)
        return (self.seconds - self.startup_seconds) / steady

    def seconds_first_round(self) -> float | None:
        """Mean wall time of the first round of each process (None before any round)."""
        return self.startup_seconds / self.startup_rounds if self.startup_rounds else None

# ---- the checkpoint file -----------------------------------------------------------------------

CHECKPOINT_FORMAT = "pfedkit-checkpoint-1"


CHECKPOINT_CLASSES = {"SimState": SimState, "DiskStates": DiskStates}  # the only objects a checkpoint holds


@dataclass
class Checkpoint:
    """What `checkpoints/latest.pt` holds: the state and the identity of the run that wrote it
    (run_identity.identity), so a checkpoint put into another run's directory is refused."""
    state: SimState
    run: dict[str, Any]


def write_checkpoint(path: str | Path, state: SimState, run: dict[str, Any]) -> None:
    """The checkpoint as plain data (run_files), written atomically. Client states on disk are
    written as their file names (`DiskStates.__getstate__`)."""
    write_data(path, {"format": CHECKPOINT_FORMAT, "run": run, "state": state}, CHECKPOINT_CLASSES)


def read_checkpoint(path: str | Path, fix: str = RESUME_FIX) -> Checkpoint:
    """The checkpoint `write_checkpoint` wrote (never unpickled); RunFileError (one line, ending
    with `fix`) for a file that is missing, damaged, not data, or not a pfedkit checkpoint."""
    saved = read_data(path, "checkpoint", fix, CHECKPOINT_CLASSES)
    if not (isinstance(saved, dict) and saved.get("format") == CHECKPOINT_FORMAT
            and isinstance(saved.get("state"), SimState) and isinstance(saved.get("run"), dict)):
        raise RunFileError(f"{path}: not a pfedkit checkpoint (expected format {CHECKPOINT_FORMAT}); {fix}")
    return Checkpoint(saved["state"], saved["run"])
