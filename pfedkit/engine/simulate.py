"""The round loop, in one place: sample, broadcast, client updates, aggregate, evaluate, checkpoint.

Client updates are generators (see `pfedkit.core.contract`); `drive_clients` steps all of a
round's participants in lock-step and hands every pending `Fit` request of a step to the runtime
at once, which is what lets a runtime train them in parallel or as one batched computation.

Threads: a run computes with ONE thread count, its clients' side's `threads` (the runtime's: the
config's `threads`, else 1 for processes / ray / Flower nodes and this process's torch count for
sequential / vectorized). `Simulation.initial_state` and `run_round` run under it
(`compute_threads`: torch and the BLAS/OpenMP pools), so every algorithm hook (init, reports,
collect, broadcast, each step of client_update, the aggregation, client_model, adapt, predict)
computes with the same count as the runtime's Fits, whichever backend runs them. A runtime may
change the count inside its own calls and restores it before it returns or yields. An algorithm
that declares `small_op_threads` (`pfedkit.core.contract.Algorithm`: CReFF) gets that torch count
for its own code instead: each step of its client updates and its aggregation (`own_code`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from functools import partial
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableSequence, Sequence

import numpy as np

from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, Message, message_bytes
from pfedkit.core.errors import ConfigError
from pfedkit.core.seeds import SERVER, numpy_rng, round_participants
from pfedkit.core.threads import compute_threads, resolved_threads, thread_count
from pfedkit.data.federated import FederatedData
from pfedkit.engine.client_states import DISK_WINDOW, DiskStates, Placement
from pfedkit.engine.protocols import Clients, EvaluatesNewClients, Runtime
from pfedkit.engine.state import SimState
from pfedkit.engine.trainer import FitJob
from pfedkit.evaluation import ClientEval, classifier_row_norms


EVAL_BLOCK = 128  # clients evaluated together (a runtime evaluates a block in parallel)
NEW_CLIENT_PURPOSE = "new-client"  # seeds of the new clients' choice and of their fine-tuning batches


def choose_new_clients(seed: int, num_clients: int, count: int) -> list[int]:
    """The `count` clients (sorted) that never train (config `new_clients`): drawn once from the
    run's seed, so the same seed gives the same new clients whatever the backend."""
    if not 0 <= count < num_clients:
        raise ValueError(f"new_clients must be in 0..{num_clients - 1}, got {count}")
    if count == 0:
        return []
    chosen = numpy_rng(seed, 0, SERVER, NEW_CLIENT_PURPOSE).choice(num_clients, size=count, replace=False)
    return sorted(int(c) for c in chosen)


class TrainingDiverged(RuntimeError):
    """A client's training loss became NaN or infinite: the run stops at that round (every later
    number would be NaN). `hint` is what the caller adds: what to change and what was kept."""

    def __init__(self, rnd: int, cid: int, loss: float) -> None:
        super().__init__(rnd, cid, loss)
        self.round, self.client, self.loss, self.hint = rnd, cid, loss, ""

    def __str__(self) -> str:
        message = f"training diverged in round {self.round}: client {self.client}'s training loss is {self.loss}"
        return f"{message}; {self.hint}" if self.hint else message


@dataclass
class RoundReport:
    round: int
    participants: list[int]
    acc_weighted: float | None
    train_seconds: float
    eval_seconds: float
    train_samples: int


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
    return stats


def _in_client_order(jobs: dict[int, FitJob], stream: Iterable[tuple[int, Any]]) -> Iterator[tuple[FitJob, Any]]:
    """(job, outcome) in increasing client id, from outcomes streamed in any order."""
    order, early = iter(sorted(jobs)), {}
    turn = next(order, None)
    for cid, outcome in stream:
        early[cid] = outcome
        while turn in early:
            yield jobs.pop(turn), early.pop(turn)
            turn = next(order, None)
    if early or turn is not None:
        raise RuntimeError(f"the runtime returned no result for client {turn}")


def _check_result(cid: int, value: Any) -> tuple[Any, Message]:
    if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict)):
        raise TypeError(f"client_update of client {cid} must return (client_state, message_dict)")
    return value


class LocalClients:
    """The clients' side of a round, run in this process: their states live in the `SimState`
    (`clients`, `buffers`, `optimizer_states`, indexed by client id: lists here, dicts on a Flower
    node that holds one client) and their Fit requests go to the runtime. The Flower server swaps
    this for another `Clients` (`pfedkit.engine.protocols`) that sends messages to nodes instead
    (`pfedkit.flower`), and each node runs this class for its own client, so both execute the same
    client math."""

    def __init__(self, algorithm: Algorithm, clients: Mapping[int, ClientData] | Sequence[ClientData],
                 runtime: Runtime, num_classes: int, eval_point: str = "after_download",
                 placement: Placement = Placement()) -> None:
        self.algorithm, self.clients, self.runtime = algorithm, clients, runtime
        self.num_classes, self.eval_point, self.placement = num_classes, eval_point, placement
        # The thread count the clients compute with: the runtime's (see the module docstring).
        self.threads = resolved_threads(getattr(runtime, "threads", None))

    def start(self, state: SimState, params: list, buffers: list, keep_optimizer_state: bool) -> None:
        """Every client's initial state, from its initial weights, in memory or on disk
        (`placement`); refused, before any but the first is built, where they cannot fit."""
        init = self.algorithm.init_client
        if params:
            rest = (init(cid, p) for cid, p in enumerate(params) if cid > 0)
            state.clients, state.optimizer_states = self.placement.place(init(0, params[0]), rest, len(params),
                                                                         keep_optimizer_state)
        state.buffers = list(buffers)

    def client_view(self, cid: int, state: SimState) -> ClientData:
        """Client `cid`'s data, with `buffers` reading its current BatchNorm statistics."""
        return dataclasses.replace(self.clients[cid], buffers_source=lambda: state.buffers[cid])

    def reports(self, rnd: int, cids: list[int], state: SimState) -> dict[int, Message]:
        """`client_report` of each of `cids` (those that send one)."""
        reports = {}
        for cid in cids:
            report = self.algorithm.client_report(rnd, cid, state.clients[cid], self.client_view(cid, state))
            if report is not None:
                reports[cid] = report
        return reports

    def train(self, rnd: int, messages: dict[int, Message], cids: list[int], state: SimState,
              receive: Callable[[int, Message], None]) -> dict[int, dict]:
        """Run `cids`' client updates; each new state replaces the old one; each reply goes to
        `receive(cid, reply)` as soon as it exists. Returns the train stats. States on disk are
        read DISK_WINDOW clients at a time (the same results: a client's randomness depends only
        on its id, the round and its request count)."""
        algo, stats = self.algorithm, {}
        window = DISK_WINDOW if isinstance(state.clients, DiskStates) else max(1, len(cids))
        for start in range(0, len(cids), window):
            updates = {cid: algo.client_update(rnd, cid, state.clients[cid], messages.get(cid, {}),
                                               self.client_view(cid, state)) for cid in cids[start:start + window]}
            stats.update(drive_clients(updates, self.runtime, rnd, state.clients, state.buffers,
                                       state.optimizer_states or None, receive,
                                       keep_trained=self.eval_point == "after_local_training",
                                       threads=algo.small_op_threads))
        return stats

    def evaluated_model(self, cid: int, client: Any, server: Any, stats: dict[int, dict]):
        """settings.md §4.1: "after_download" = the model the client would use now, after the
        round's aggregation (`client_model`: what it downloads next, PFLlib's evaluation at the start
        of the next round); "after_local_training" = a participant's model as its last Fit of the
        round returned it (non-participants: `client_model`, their model did not change)."""
        if self.eval_point == "after_local_training" and "trained" in stats.get(cid, {}):
            return self.algorithm.trained_model(cid, client, stats[cid]["trained"])
        return self.algorithm.client_model(cid, server, client)

    def evaluate(self, rnd: int, cids: list[int], state: SimState, stats: dict[int, dict]
                 ) -> tuple[dict[int, ClientEval], dict[int, np.ndarray]]:
        """Each of `cids` evaluates its model on its test data: {cid: ClientEval}, and {cid: the
        output layer's row norms} (nan: no Linear head). Clients go in blocks of EVAL_BLOCK, so
        the models built for evaluation (a mix per client for APFL, an adapted copy for FedBABU)
        are held for one block at a time, not for every client at once."""
        evals, norms = {}, {}
        for start in range(0, len(cids), EVAL_BLOCK):
            block_evals, block_norms = self._evaluate_block(rnd, cids[start:start + EVAL_BLOCK], state, stats)
            evals.update(block_evals)
            norms.update(block_norms)
        return evals, norms

    def _evaluate_block(self, rnd: int, cids: list[int], state: SimState, stats: dict[int, dict]
                        ) -> tuple[dict[int, ClientEval], dict[int, np.ndarray]]:
        algo = self.algorithm
        custom = algo.has_custom_predict()
        clients = {cid: state.clients[cid] for cid in cids}  # read once each (states may live on disk)
        models = {cid: (self.evaluated_model(cid, client, state.server, stats), state.buffers[cid])
                  for cid, client in clients.items()}
        if algo.has_adaptation():
            models.update(self._adapted(rnd, state.server, clients, models))
        items = [(cid, params, buffers, partial(algo.predict, cid, state.server, clients[cid]) if custom else None)
                 for cid, (params, buffers) in models.items()]
        evals = self.runtime.evaluate_many(items)
        norms = {cid: classifier_row_norms(models[cid][0], self.num_classes) for cid in cids}
        return evals, norms

    def _adapted(self, rnd: int, server: Any, clients: dict[int, Any], models: dict[int, tuple]) -> dict[int, tuple]:
        """Evaluation-time adaptation (`Algorithm.adapt`): the clients' adapted models and BatchNorm
        statistics, trained by the runtime like any Fit and never written back into the state."""
        algo, jobs = self.algorithm, []
        for cid, (params, buffers) in models.items():
            request = algo.adapt(cid, server, clients[cid], params)
            if request is not None:
                jobs.append(FitJob(rnd, cid, 0, request, buffers, None, purpose="adapt"))
        outcomes = self.runtime.fit_many(jobs) if jobs else {}
        return {cid: (outcome.params, outcome.buffers) for cid, outcome in outcomes.items()}

    def evaluate_new(self, rnd: int, cids: list[int], state: SimState, finetune_epochs: int
                     ) -> tuple[dict[int, ClientEval], dict[int, np.ndarray]]:
        """Clients that never trained (config `new_clients`): each receives `joining_model` (given
        its fresh state, which nothing ever changed), trains `finetune_epochs` epochs of plain SGD
        on its training split (a Fit through the runtime, seeded apart from training and
        adaptation), and is evaluated on its test split. Nothing is written back: the next
        evaluation starts again from what the client receives then. The algorithm's `adapt` is not
        applied: `finetune_epochs` is the newcomers' adaptation."""
        evals, norms = {}, {}
        for start in range(0, len(cids), EVAL_BLOCK):
            block_evals, block_norms = self._evaluate_new_block(rnd, cids[start:start + EVAL_BLOCK], state,
                                                                finetune_epochs)
            evals.update(block_evals)
            norms.update(block_norms)
        return evals, norms

    def _evaluate_new_block(self, rnd: int, cids: list[int], state: SimState, finetune_epochs: int
                            ) -> tuple[dict[int, ClientEval], dict[int, np.ndarray]]:
        algo, server = self.algorithm, state.server
        fresh = {cid: state.clients[cid] for cid in cids}
        models = {cid: (algo.joining_model(cid, server, client, self.client_view(cid, state)), state.buffers[cid])
                  for cid, client in fresh.items()}
        if finetune_epochs > 0:
            jobs = [FitJob(rnd, cid, 0, Fit(params, epochs=finetune_epochs), buffers, None, purpose=NEW_CLIENT_PURPOSE)
                    for cid, (params, buffers) in models.items()]
            models = {cid: (outcome.params, outcome.buffers) for cid, outcome in self.runtime.fit_many(jobs).items()}
        custom = algo.has_custom_predict()
        items = [(cid, params, buffers, partial(algo.predict, cid, server, fresh[cid]) if custom else None)
                 for cid, (params, buffers) in models.items()]
        evals = self.runtime.evaluate_many(items)
        return evals, {cid: classifier_row_norms(models[cid][0], self.num_classes) for cid in cids}


class Simulation:
    """The round loop over an algorithm; `clients` is the clients' side (default: `LocalClients`
    over `data` and `runtime`; the Flower server passes one that talks to nodes, and no runtime)."""

    def __init__(self, algorithm: Algorithm, data: FederatedData, runtime: Runtime | None, *, rounds: int,
                 seed: int, join_ratio: float, eval_every: int, keep_optimizer_state: bool = False,
                 eval_point: str = "after_download", participants: str = "round", clients: Clients | None = None,
                 placement: Placement = Placement(), new_clients: int = 0, new_client_finetune: int = 0) -> None:
        self.algorithm, self.data, self.runtime = algorithm, data, runtime
        self.rounds, self.seed, self.join_ratio, self.eval_every = rounds, seed, join_ratio, eval_every
        self.keep_optimizer_state, self.participants = keep_optimizer_state, participants
        if eval_point not in ("after_download", "after_local_training"):
            raise ValueError(f"eval_point must be 'after_download' or 'after_local_training', got {eval_point!r}")
        self.eval_point = eval_point
        self.clients = clients or LocalClients(algorithm, data.clients, runtime, data.num_classes, eval_point,
                                                   placement)
        # Server-side code computes with the clients' count, so no number depends on the backend.
        self.threads = resolved_threads(getattr(self.clients, "threads", None))
        self.new_clients = self._new_clients(new_clients, new_client_finetune)
        self.new_client_finetune = new_client_finetune
        # Only these are ever sampled, asked for reports or aggregated; with no new clients, all.
        self.is_new = frozenset(self.new_clients)
        self.training_clients = [cid for cid in range(data.num_clients) if cid not in self.is_new]
        self.timed_a_round = False  # see SimState.startup_seconds

    def _new_clients(self, count: int, finetune: int) -> list[int]:
        """The clients kept out of training, or a one-line ConfigError where they cannot be evaluated."""
        if count == 0:
            return []
        if count >= self.data.num_clients or count < 0 or finetune < 0:
            raise ConfigError(f"new_clients={count}, new_client_finetune={finetune}: allowed new_clients "
                              f"0..{self.data.num_clients - 1} and new_client_finetune >= 0")
        reason = self.algorithm.new_client_refusal()
        if reason:
            raise ConfigError(f"new_clients: algorithm {self.algorithm.name} cannot evaluate clients that never "
                              f"trained ({reason}); use new_clients=0")
        if not isinstance(self.clients, EvaluatesNewClients):
            raise ConfigError(f"new_clients: not available with {type(self.clients).__name__} (clients on other "
                              "machines); use new_clients=0 or pfedkit run")
        return choose_new_clients(self.seed, self.data.num_clients, count)

    def initial_state(self, params, buffers, client_params: list | None = None,
                      client_buffers: list | None = None) -> SimState:
        """`params`/`buffers`: the default architecture's initial weights (the server's, and every
        client's unless `client_params`/`client_buffers` give each client its own: heterogeneous models)."""
        with compute_threads(self.threads):
            return self._initial_state(params, buffers, client_params, client_buffers)

    def _initial_state(self, params, buffers, client_params: list | None, client_buffers: list | None) -> SimState:
        algo, n = self.algorithm, self.data.num_clients
        state = SimState(0, None, [], [])
        self.clients.start(state, client_params or [params] * n, client_buffers or [buffers] * n,
                           self.keep_optimizer_state)
        state.server = algo.init_server(params)
        algo.diagnostics = state.diagnostics
        # New clients take no part in the setup exchange either: the server never hears of them.
        setup_bytes = self.exchange_reports(0, self.training_clients, state)
        if setup_bytes:
            state.rows.extend(self._rows(0, sorted(setup_bytes), {}, setup_bytes, {}, {}, {}))
        return state

    def exchange_reports(self, rnd: int, cids: list[int], state: SimState) -> dict[int, int]:
        """Ask `cids` for their `client_report`, hand those sent to `collect`; bytes up per reporter."""
        reports = self.clients.reports(rnd, cids, state)
        if reports:
            state.server = self.algorithm.collect(rnd, state.server, reports)
        return {cid: message_bytes(report) for cid, report in reports.items()}

    def run_round(self, state: SimState) -> RoundReport:
        with compute_threads(self.threads):
            return self._run_round(state)

    def round_participants(self, rnd: int) -> list[int]:
        """The clients sampled in round `rnd`, among the training clients (all N without new
        clients: the same draw as ever). The privacy accountant reads the same draw."""
        return round_participants(self.seed, rnd, self.training_clients, self.join_ratio, self.participants)

    def _run_round(self, state: SimState) -> RoundReport:
        rnd = state.round + 1
        algo = self.algorithm
        algo.diagnostics = state.diagnostics
        started = time.perf_counter()
        cids = self.round_participants(rnd)
        reported = self.exchange_reports(rnd, cids, state)
        messages = algo.broadcast(rnd, state.server, cids)
        aggregation, reply_bytes = algo.start_aggregation(rnd, state.server, cids), {}

        def receive(cid: int, reply: Message) -> None:
            reply_bytes[cid] = message_bytes(reply)  # counted here, then held by nobody but the aggregation
            with own_code(algo.small_op_threads):
                aggregation.add(cid, reply)

        stats = self.clients.train(rnd, messages, cids, state, receive)
        with own_code(algo.small_op_threads):
            state.server = aggregation.finish()
        trained = time.perf_counter()
        evals = self._evaluate(rnd, state, stats) if rnd % self.eval_every == 0 or rnd == self.rounds else {}
        evaluated = time.perf_counter()
        state.rows.extend(self._rows(rnd, cids, messages, reported, reply_bytes, stats, evals))
        state.round = rnd
        state.seconds += evaluated - started
        if not self.timed_a_round:  # this process's first round: start-up costs, kept apart
            self.timed_a_round = True
            state.startup_seconds += evaluated - started
            state.startup_rounds += 1
        known = [e for cid, e in evals.items() if cid not in self.is_new]  # the participants' side only
        weighted = (sum(e.correct for e in known) / max(1, sum(e.n_test for e in known))
                    if evals else None)
        samples = sum(s["samples"] for s in stats.values())
        return RoundReport(rnd, cids, weighted, trained - started, evaluated - trained, samples)

    def _evaluate(self, rnd: int, state: SimState, stats: dict[int, dict]):
        n, c = self.data.num_clients, self.data.num_classes
        evals, norms = self.clients.evaluate(rnd, self.training_clients, state, stats)
        if self.new_clients:
            new_evals, new_norms = self.clients.evaluate_new(rnd, self.new_clients, state, self.new_client_finetune)
            evals, norms = {**evals, **new_evals}, {**norms, **new_norms}
        # A client that did not answer (a Flower node gone) has no row: zeros / nan.
        state.class_correct = np.stack([evals[k].class_correct if k in evals else np.zeros(c, np.int64)
                                        for k in range(n)])
        state.class_total = np.stack([evals[k].class_total if k in evals else np.zeros(c, np.int64)
                                      for k in range(n)])
        state.head_row_norms = np.stack([norms.get(k, np.full(c, np.nan)) for k in range(n)])
        return evals

    def _rows(self, rnd, cids, messages, reported, reply_bytes, stats, evals) -> list[dict]:
        """One metrics row per client; `reported`: bytes of the round's client_report uploads,
        `reply_bytes`: bytes of each reply received.
        `dropped` marks a participant whose reply never came (a Flower node that died or timed out)."""
        rows, joined = [], set(cids)
        for cid, client in enumerate(self.data.clients):
            ev = evals.get(cid)
            steps = stats[cid]["steps"] if cid in stats else 0
            rows.append({
                "round": rnd, "client": cid, "participated": int(cid in joined),
                "n_train": client.n_train, "n_test": client.n_test,
                "correct": ev.correct if ev else np.nan,
                "accuracy": ev.accuracy if ev else np.nan,
                "loss": ev.loss if ev else np.nan,
                "balanced_acc": ev.balanced_accuracy if ev else np.nan,
                "train_loss": stats[cid]["loss"] / steps if steps else np.nan,
                "train_steps": steps,
                "bytes_down": message_bytes(messages.get(cid)) if cid in joined else 0,
                "bytes_up": (reply_bytes.get(cid, 0) + reported.get(cid, 0)) if cid in joined else 0,
                "dropped": int(cid in joined and rnd > 0 and cid not in reply_bytes),
            })
            if self.new_clients:  # the column exists only then: without new clients, metrics.csv as before
                rows[-1]["new_client"] = int(cid in self.is_new)
        return rows
