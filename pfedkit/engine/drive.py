"""Driving a round's client updates: the generator driver between the clients' math and a runtime.

Client updates are generators (see `pfedkit.core.contract`): each yields `Fit` requests and
returns (new client state, reply). `drive_clients` steps all of a round's participants in
lock-step and hands every pending `Fit` of a step to the runtime at once, which is what lets a
runtime train them in parallel or as one batched computation; results are used in client order,
whatever order they come in, so no number depends on the runtime.

`own_code` is the thread count of an algorithm's own code (its `small_op_threads`), applied around
each step of its client updates here and around its aggregation by the round loop.
`TrainingDiverged` is raised here, where a non-finite training loss is first seen.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, MutableSequence
from typing import Any

from pfedkit.core.contract import ClientUpdate, Message
from pfedkit.core.threads import thread_count
from pfedkit.engine.protocols import Runtime
from pfedkit.engine.trainer import FitJob


class TrainingDiverged(RuntimeError):
    """A client's training loss became NaN or infinite: the run stops at that round (every later
    number would be NaN). `hint` is what the caller adds: what to change and what was kept."""

    def __init__(self, rnd: int, cid: int, loss: float) -> None:
        super().__init__(rnd, cid, loss)
        self.round, self.client, self.loss, self.hint = rnd, cid, loss, ""

    def __str__(self) -> str:
        message = f"training diverged in round {self.round}: client {self.client}'s training loss is {self.loss}"
        return f"{message}; {self.hint}" if self.hint else message


def own_code(threads: int | None) -> contextlib.AbstractContextManager:
    """The torch thread count for an algorithm's own code: its `small_op_threads` (a number), or
    the run's count, left as it is (None)."""
    return thread_count(threads) if threads else contextlib.nullcontext()


def drive_clients(updates: dict[int, ClientUpdate], runtime: Runtime, rnd: int, clients: MutableSequence | dict,
                  buffers: list[Any], optimizer_states: list[dict[str, Any]] | None = None,
                  receive: Callable[[int, Message], None] | None = None, keep_trained: bool = False,
                  threads: int | None = None) -> dict[int, dict]:
    """Run every participant's client_update to completion; returns the train stats.

    Each step, every pending Fit goes to the runtime at once; results are taken as the runtime
    streams them and each client's update resumes in client order (a result that comes before its
    turn waits). When a client_update returns, its new state replaces `clients[cid]` at once (the
    old one is freed then, not at the end of the round) and `receive(cid, reply)` gets the reply,
    which nothing here keeps. `buffers[cid]` (BatchNorm statistics) and, when given,
    `optimizer_states[cid]` (kept optimizer state, one entry per `Fit.optimizer` name) are read
    into each job and updated in place. `keep_trained`: keep each client's last trained model in
    its stats (`eval_point=after_local_training`). `threads`: the algorithm's `small_op_threads`,
    for the updates' own steps (not for the runtime's Fits)."""
    stats = {cid: {"loss": 0.0, "steps": 0, "samples": 0} for cid in updates}
    pending, counts = {}, {cid: 0 for cid in updates}

    def advance(cid: int, value: Any, first: bool) -> None:
        with own_code(threads):  # the algorithm's own code between two Fits
            try:
                pending[cid] = next(updates[cid]) if first else updates[cid].send(value)
                return
            except StopIteration as stop:
                result = stop.value
        clients[cid], reply = _check_result(cid, result)
        if receive is not None:
            receive(cid, reply)

    for cid in updates:
        advance(cid, None, True)
    while pending:
        jobs = {cid: FitJob(rnd, cid, counts[cid], request, buffers[cid],
                            optimizer_states[cid].get(request.optimizer) if optimizer_states is not None else None)
                for cid, request in sorted(pending.items())}
        pending = {}
        # The runtime empties the list as it hands jobs out and `_in_client_order` drops each job
        # once its result is used, so a client's old model is freed as soon as its new one exists.
        for job, outcome in _in_client_order(jobs, runtime.fit_stream(list(jobs.values()))):
            if not math.isfinite(outcome.mean_loss):
                raise TrainingDiverged(rnd, job.cid, outcome.mean_loss)
            buffers[job.cid] = outcome.buffers
            if optimizer_states is not None and outcome.optimizer_state is not None:
                kept = optimizer_states[job.cid]  # read, changed, written back: states may live on disk
                kept[job.request.optimizer] = outcome.optimizer_state
                optimizer_states[job.cid] = kept
            counts[job.cid] += 1
            stats[job.cid]["loss"] += outcome.mean_loss * outcome.steps
            stats[job.cid]["steps"] += outcome.steps
            stats[job.cid]["samples"] += outcome.samples
            if keep_trained:
                stats[job.cid]["trained"] = outcome.params  # the model after local training (eval_point)
            advance(job.cid, outcome.params, False)
            # Not held while the runtime trains its next chunk: a chunk's trained models are one
            # host buffer, kept alive by any one reply (vectorized runtime, issue 49).
            del job, outcome
    return stats


def _in_client_order(jobs: dict[int, FitJob], stream: Iterable[tuple[int, Any]]) -> Iterator[tuple[FitJob, Any]]:
    """(job, outcome) in increasing client id, from outcomes streamed in any order."""
    order, early = iter(sorted(jobs)), {}
    turn = next(order, None)
    for cid, outcome in stream:
        early[cid] = outcome
        del outcome  # see drive_clients: nothing here holds a result past its use
        while turn in early:
            yield jobs.pop(turn), early.pop(turn)
            turn = next(order, None)
    if early or turn is not None:
        raise RuntimeError(f"the runtime returned no result for client {turn}")


def _check_result(cid: int, value: Any) -> tuple[Any, Message]:
    if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict)):
        raise TypeError(f"client_update of client {cid} must return (client_state, message_dict)")
    return value
