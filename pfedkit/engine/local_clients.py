"""The clients' side of a round, run in this process (`LocalClients`): what the round loop
(`pfedkit.engine.simulate.Simulation`) calls through the `Clients` protocol, answered over a
runtime, with `EvaluatesNewClients` for clients that never train (config `new_clients`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np

from pfedkit.core.contract import Algorithm, ClientData, Fit, Message
from pfedkit.engine.client_states import DISK_WINDOW, DiskStates, Placement
from pfedkit.engine.drive import drive_clients
from pfedkit.engine.protocols import OnInputs, Runtime
from pfedkit.engine.state import SimState
from pfedkit.engine.trainer import FitJob
from pfedkit.evaluation import ClientEval, classifier_row_norms


EVAL_BLOCK = 128  # clients evaluated together (a runtime evaluates a block in parallel); a runtime's
# `eval_block` attribute replaces it (vectorized: as many as it trains together, one batched evaluation)
NEW_CLIENT_PURPOSE = "new-client"  # seeds of the new clients' choice and of their fine-tuning batches


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

    def describe_devices(self) -> str:
        """Where these clients train: the runtime's device(s)."""
        return self.runtime.describe_devices()

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
        block = getattr(self.runtime, "eval_block", None) or EVAL_BLOCK  # vectorized on a GPU: its chunk
        for start in range(0, len(cids), block):
            block_evals, block_norms = self._evaluate_block(rnd, cids[start:start + block], state, stats)
            evals.update(block_evals)
            norms.update(block_norms)
        return evals, norms

    def _evaluate_block(self, rnd: int, cids: list[int], state: SimState, stats: dict[int, dict]
                        ) -> tuple[dict[int, ClientEval], dict[int, np.ndarray]]:
        algo = self.algorithm
        clients = {cid: state.clients[cid] for cid in cids}  # read once each (states may live on disk)
        models = {cid: (self.evaluated_model(cid, client, state.server, stats), state.buffers[cid])
                  for cid, client in clients.items()}
        if algo.has_adaptation():
            models.update(self._adapted(rnd, state.server, clients, models))
        predicting = self._evaluation_states(state.server, clients, models)
        items = [(cid, params, buffers, self._prediction(cid, state.server, predicting[cid], buffers))
                 for cid, (params, buffers) in models.items()]
        evals = self.runtime.evaluate_many(items)
        norms = {cid: classifier_row_norms(models[cid][0], self.num_classes) for cid in cids}
        return evals, norms

    def _evaluation_states(self, server: Any, clients: dict[int, Any], models: dict[int, tuple]) -> dict[int, Any]:
        """The state each client predicts with (`Algorithm.evaluation_state`), given the model and
        BatchNorm statistics it is measured with; thrown away after the evaluation."""
        states = {}
        for cid, (params, buffers) in models.items():
            data = dataclasses.replace(self.clients[cid], buffers_source=lambda buffers=buffers: buffers)
            states[cid] = self.algorithm.evaluation_state(cid, server, clients[cid], params, data)
        return states

    def _prediction(self, cid: int, server: Any, client: Any, buffers: Any) -> Callable | None:
        """How client `cid` predicts (the `predict` of its `EvalItem`): from the inputs
        (`predict_inputs`, with the evaluated buffers), from the body features (`predict`), or with
        the evaluated model itself (None)."""
        algo = self.algorithm
        if algo.has_input_predict():
            return OnInputs(partial(algo.predict_inputs, cid, server, client, buffers=buffers))
        if algo.has_custom_predict():
            return partial(algo.predict, cid, server, client)
        return None

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
        fresh = {cid: algo.joining_state(cid, server, state.clients[cid], self.client_view(cid, state))
                 for cid in cids}
        models = {cid: (algo.joining_model(cid, server, client, self.client_view(cid, state)), state.buffers[cid])
                  for cid, client in fresh.items()}
        if finetune_epochs > 0:
            jobs = [FitJob(rnd, cid, 0, Fit(params, epochs=finetune_epochs), buffers, None, purpose=NEW_CLIENT_PURPOSE)
                    for cid, (params, buffers) in models.items()]
            models = {cid: (outcome.params, outcome.buffers) for cid, outcome in self.runtime.fit_many(jobs).items()}
        predicting = self._evaluation_states(server, fresh, models)
        items = [(cid, params, buffers, self._prediction(cid, server, predicting[cid], buffers))
                 for cid, (params, buffers) in models.items()]
        evals = self.runtime.evaluate_many(items)
        return evals, {cid: classifier_row_norms(models[cid][0], self.num_classes) for cid in cids}
