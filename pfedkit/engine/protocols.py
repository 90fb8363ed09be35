"""The two interfaces of the round loop, as `typing.Protocol`s: what `Simulation` and
`LocalClients` (engine/simulate.py, engine/local_clients.py) call, and nothing more.

- `Runtime`: who answers a round's Fit requests and evaluates clients (engine/runtimes/:
  sequential, processes, vectorized, ray). The round loop never knows which one runs.
- `Clients`: the clients' side of a round as `Simulation` sees it: `LocalClients` (in this
  process, over a `Runtime`), or `pfedkit.flower.server.FlowerClients` (messages to Flower nodes).
  `EvaluatesNewClients` is the optional extra step for clients that never trained
  (config `new_clients`); `Simulation` refuses `new_clients` with clients that lack it.

They are structural: a runtime does not inherit from `Runtime`. `tests/test_protocols.py` checks
every runtime and both clients' sides against them, parameter by parameter.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from pfedkit.core.contract import Message
from pfedkit.core.params import Params
from pfedkit.engine.state import SimState
from pfedkit.engine.trainer import FitJob, FitOutcome
from pfedkit.evaluation import ClientEval


class OnInputs:
    """A client's prediction from the test inputs themselves (`Algorithm.predict_inputs` bound to
    the client's states and buffers): the evaluator calls it on each batch of inputs instead of
    the loaded model (FedEM's mixture of K full models). A plain callable in an `EvalItem` maps
    body features to logits (`Algorithm.predict`)."""

    def __init__(self, predict: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.predict = predict

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.predict(x)


# (cid, params, buffers, predict): predict maps body features to logits when the algorithm does
# not use the model's head for prediction (an `OnInputs`: inputs to logits, the loaded model
# unused), else None.
EvalItem = tuple[int, Params, Params | None, Callable[[torch.Tensor], torch.Tensor] | None]


@runtime_checkable
class Runtime(Protocol):
    """Answers Fit requests (`FitJob`s) and evaluations; every job carries its own seeds, so the
    results do not depend on which runtime answers or in which order.

    It computes with the thread count it was built with (`pfedkit.build.run_threads`, which the
    round loop is given too); it may change the count inside its calls but restores it before it
    returns or yields. Optional: an `eval_block` attribute (int, or None for the default) asks the
    round loop for that many clients per `evaluate_many` (vectorized on a GPU: one batched chunk)."""

    def fit_stream(self, jobs: list[FitJob]) -> Iterator[tuple[int, FitOutcome]]:
        """(cid, outcome) in any order, as they are done; empties `jobs` as it hands them out, so
        a job's inputs are freed when its result is taken."""
        ...

    def fit_many(self, jobs: list[FitJob]) -> dict[int, FitOutcome]:
        """All of them at once (evaluation-time adaptation, new clients' fine-tuning)."""
        ...

    def evaluate_many(self, items: list[EvalItem]) -> dict[int, ClientEval]:
        """Each item's model on its client's test split."""
        ...

    def describe_devices(self) -> str:
        """Where its clients train, in words (`engine.device.describe_device`): the summary's `device`."""
        ...

    def close(self) -> None:
        """Release workers, actors, device memory; called once when the run ends."""
        ...


@runtime_checkable
class Clients(Protocol):
    """The clients' side of the round loop; their states live in the `SimState` (in this process)
    or on the nodes."""

    def start(self, state: SimState, params: list, buffers: list, keep_optimizer_state: bool) -> None:
        """Every client's initial state from its initial weights (or nothing, where nodes make their own)."""
        ...

    def reports(self, rnd: int, cids: list[int], state: SimState) -> dict[int, Message]:
        """`client_report` of each of `cids` that sends one."""
        ...

    def train(self, rnd: int, messages: dict[int, Message], cids: list[int], state: SimState,
              receive: Callable[[int, Message], None]) -> dict[int, dict]:
        """`cids`' client updates; each reply goes to `receive(cid, reply)`; returns the train stats."""
        ...

    def evaluate(self, rnd: int, cids: list[int], state: SimState, stats: dict[int, dict]
                 ) -> tuple[dict[int, ClientEval], dict[int, np.ndarray]]:
        """{cid: ClientEval} and {cid: output-layer row norms} of each of `cids`' evaluated model."""
        ...

    def describe_devices(self) -> str:
        """Where the clients trained, in words: the summary's `device` (Flower nodes choose their own)."""
        ...


@runtime_checkable
class EvaluatesNewClients(Protocol):
    """Clients' sides that can evaluate clients that never trained (config `new_clients`)."""

    def evaluate_new(self, rnd: int, cids: list[int], state: SimState, finetune_epochs: int
                     ) -> tuple[dict[int, ClientEval], dict[int, np.ndarray]]:
        ...

