"""The round loop, in one place: sample, broadcast, client updates, aggregate, evaluate, checkpoint.

`Simulation` runs it over an algorithm and a clients' side (`pfedkit.engine.protocols.Clients`):
`LocalClients` (engine/local_clients.py: in this process, over a runtime, through the generator
driver of engine/drive.py) or the Flower server's clients on nodes. It never sees a runtime's
Fit requests; it sees replies, which it hands to the round's aggregation as they come.

Threads: a run computes with ONE thread count, `threads`, decided by whoever builds the run
(`pfedkit.build.run_threads`: the config's `threads`, else 1 for processes / ray / Flower nodes and
this process's torch count for sequential / vectorized) and passed both to the runtime and here.
`Simulation.initial_state` and `run_round` run under it
(`compute_threads`: torch and the BLAS/OpenMP pools), so every algorithm hook (init, reports,
collect, broadcast, each step of client_update, the aggregation, client_model, adapt, predict)
computes with the same count as the runtime's Fits, whichever backend runs them. A runtime may
change the count inside its own calls and restores it before it returns or yields. An algorithm
that declares `small_op_threads` (`pfedkit.core.contract.Algorithm`: CReFF) gets that torch count
for its own code instead: each step of its client updates and its aggregation (`own_code`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from pfedkit.core.aggregation import Aggregation, StartAggregation
from pfedkit.core.contract import Algorithm, Message, message_bytes
from pfedkit.core.errors import ConfigError
from pfedkit.core.seeds import SERVER, numpy_rng, round_participants
from pfedkit.core.threads import compute_threads
from pfedkit.data.federated import FederatedData
from pfedkit.engine.client_states import Placement
from pfedkit.engine.drive import own_code
from pfedkit.engine.local_clients import NEW_CLIENT_PURPOSE, LocalClients
from pfedkit.engine.protocols import Clients, EvaluatesNewClients, Runtime
from pfedkit.engine.state import SimState


def choose_new_clients(seed: int, num_clients: int, count: int) -> list[int]:
    """The `count` clients (sorted) that never train (config `new_clients`): drawn once from the
    run's seed, so the same seed gives the same new clients whatever the backend."""
    if not 0 <= count < num_clients:
        raise ValueError(f"new_clients must be in 0..{num_clients - 1}, got {count}")
    if count == 0:
        return []
    chosen = numpy_rng(seed, 0, SERVER, NEW_CLIENT_PURPOSE).choice(num_clients, size=count, replace=False)
    return sorted(int(c) for c in chosen)


@dataclass
class RoundReport:
    round: int
    participants: list[int]
    acc_weighted: float | None
    train_seconds: float
    eval_seconds: float
    train_samples: int


class Simulation:
    """The round loop over an algorithm; `clients` is the clients' side (default: `LocalClients`
    over `data` and `runtime`; the Flower server passes one that talks to nodes, and no runtime).
    `start_aggregation`: how each round's replies are aggregated when not by the algorithm's own
    `start_aggregation` (client-level DP's noised mean, `pfedkit.privacy`: the algorithm never knows)."""

    def __init__(self, algorithm: Algorithm, data: FederatedData, runtime: Runtime | None, *, threads: int,
                 start_aggregation: StartAggregation | None = None, rounds: int, seed: int, join_ratio: float,
                 eval_every: int, keep_optimizer_state: bool = False,
                 eval_point: str = "after_download", participants: str = "round", clients: Clients | None = None,
                 placement: Placement = Placement(), new_clients: int = 0, new_client_finetune: int = 0) -> None:
        self.algorithm, self.data, self.runtime = algorithm, data, runtime
        self.aggregation_policy = start_aggregation
        self.rounds, self.seed, self.join_ratio, self.eval_every = rounds, seed, join_ratio, eval_every
        self.keep_optimizer_state, self.participants = keep_optimizer_state, participants
        if eval_point not in ("after_download", "after_local_training"):
            raise ValueError(f"eval_point must be 'after_download' or 'after_local_training', got {eval_point!r}")
        self.eval_point = eval_point
        self.clients = clients or LocalClients(algorithm, data.clients, runtime, data.num_classes, eval_point,
                                                   placement)
        # The runtime's count (the builder passed both the same), so no number depends on the backend.
        self.threads = threads
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
        aggregation, reply_bytes = self.start_aggregation(rnd, state.server, cids), {}

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

    def start_aggregation(self, rnd: int, server: Any, cids: list[int]) -> Aggregation:
        """Round `rnd`'s aggregation: the policy given from outside, else the algorithm's own (looked
        up each round, as the algorithm's other hooks are)."""
        start = self.aggregation_policy or self.algorithm.start_aggregation
        return start(rnd, server, cids)

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
