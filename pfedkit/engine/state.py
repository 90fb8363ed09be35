"""A simulation's state between rounds: what the round loop updates, checkpoints and resumes from,
and what the clients side (`engine.protocols.Clients`) reads and writes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


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
