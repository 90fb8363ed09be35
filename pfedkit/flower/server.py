"""The ServerApp side: pfedkit's own round loop, with the clients' side on Flower nodes.

`serve` runs the same `Simulation` as `pfedkit run`: the algorithm's `broadcast`, `collect` and
`aggregate` run here, on the server; `FlowerClients` stands in for `LocalClients` and turns each
client step into messages to the nodes (a personalised message per node):

    identify   QUERY    before round 1: node id -> client id (the node's partition-id)
    report     QUERY    client_report (round 0 for every client, then each round's participants)
    train      TRAIN    client_update on the broadcast message; the reply message and train stats
    evaluate   EVALUATE every client evaluates its model; the message carries the server state

Every `send_and_receive` waits at most `flower.round_timeout` seconds. A node that does not
answer in time, or answers with an error, is left out of that step: the round aggregates the
replies that arrived, and the metrics rows of the missing participants have `dropped = 1`.

The evaluation message carries the whole server state because `client_model`, `predict` and
`adapt` may read it (the in-process simulation evaluates with server and client state at hand).
It is evaluation traffic, outside the algorithm's messages, so it is not counted in `bytes_down`
(nor is it in the simulation).
"""
from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from pfedkit.config import Config
from pfedkit.core.contract import Message as AlgoMessage
from pfedkit.engine.state import SimState
from pfedkit.evaluation import ClientEval
from pfedkit.flower.node import HEADER, PAYLOAD
from pfedkit.flower.records import pack, put_packed, take

log = logging.getLogger("pfedkit.flower")


class NodesMissing(RuntimeError):
    pass


class FlowerClients:
    """The clients' side of the round loop (see `LocalClients`), answered by Flower nodes."""

    def __init__(self, grid: Grid, config: Config, asks_reports: bool = True) -> None:
        self.grid, self.config, self.asks_reports = grid, config, asks_reports
        self.config_text = json.dumps(config.to_dict(), sort_keys=True)
        self.timeout = config.flower.round_timeout
        self.nodes = self.identify(config.num_clients, config.flower.connect_timeout)
        self.devices: dict[int, str] = {}  # client id -> the device its node reported (`describe_device`)

    def start(self, state: SimState, params: list, buffers: list, keep_optimizer_state: bool) -> None:
        """Nothing to do here: each node makes its client's initial state at its first message."""

    def close(self) -> None:
        pass

    def identify(self, count: int, wait: float) -> dict[int, int]:
        """client id -> node id, once all `count` nodes are connected (at most `wait` seconds)."""
        deadline = time.monotonic() + wait
        while len(node_ids := list(self.grid.get_node_ids())) < count:
            if time.monotonic() > deadline:
                raise NodesMissing(f"{len(node_ids)} of {count} nodes connected after {wait:.0f} s "
                                   "(flower.connect_timeout); start one SuperNode per client")
            time.sleep(1.0)
        answers = self._exchange("identify", 0, {node: None for node in node_ids}, MessageType.QUERY, by_node=True)
        nodes: dict[int, int] = {}
        for node, answer in answers.items():
            cid = int(answer["partition_id"])
            if cid in nodes:
                raise NodesMissing(f"nodes {nodes[cid]} and {node} both say partition-id={cid}")
            nodes[cid] = node
        missing = sorted(set(range(count)) - set(nodes))
        if missing:
            raise NodesMissing(f"no node has partition-id {missing[:10]} (nodes must have partition-id 0..{count - 1})")
        return nodes

    def reports(self, rnd: int, cids: list[int], state: SimState) -> dict[int, AlgoMessage]:
        if not self.asks_reports:  # the algorithm never sends one: spare the nodes a message
            return {}
        answers = self._exchange("report", rnd, {cid: None for cid in cids}, MessageType.QUERY)
        return {cid: report for cid, report in answers.items() if report is not None}

    def train(self, rnd: int, messages: dict[int, AlgoMessage], cids: list[int], state: SimState,
              receive: Callable[[int, AlgoMessage], None]) -> dict[int, dict]:
        answers = self._exchange("train", rnd, {cid: messages.get(cid, {}) for cid in cids}, MessageType.TRAIN)
        for cid in sorted(answers):
            self.note_device(cid, answers[cid].get("device"))
            receive(cid, answers[cid]["reply"])
        return {cid: {key: answer[key] for key in ("loss", "steps", "samples")} for cid, answer in answers.items()}

    def describe_devices(self) -> str:
        """The summary's `device`: each device the nodes reported, with its clients' count
        (`cpu (AVX2) x 3, cuda:0 (NVIDIA H200) x 1`), not the server's own device."""
        counts = Counter(self.devices.values())
        return ", ".join(f"{name} x {counts[name]}" for name in sorted(counts)) or "not reported by any node"

    def note_device(self, cid: int, device: str | None) -> None:
        """Log the device a client's node trains on, the first time it says (nodes choose their own)."""
        if device is not None and self.devices.get(cid) != device:
            self.devices[cid] = device
            log.info("client %d trains on %s", cid, device)

    def evaluate(self, rnd: int, cids: list[int], state: SimState, stats: dict[int, dict]
                 ) -> tuple[dict[int, ClientEval], dict[int, np.ndarray]]:
        shared = pack(state.server)  # one encoding, sent to every node
        answers = self._exchange("evaluate", rnd, {cid: shared for cid in cids}, MessageType.EVALUATE, packed=True)
        evals = {cid: ClientEval(a["correct"], a["n_test"], a["loss_sum"], a["class_correct"], a["class_total"])
                 for cid, a in answers.items()}
        return evals, {cid: answer["norms"] for cid, answer in answers.items()}

    def _exchange(self, op: str, rnd: int, payloads: dict[int, Any], kind: str, *, by_node: bool = False,
                  packed: bool = False) -> dict[int, Any]:
        """Send each target its payload, wait for the replies; {target: decoded answer} of those that
        came back in time without error (targets are client ids, or node ids when `by_node`)."""
        header = ConfigRecord({"op": op, "round": rnd, "config": self.config_text})
        outgoing = []
        for target, payload in payloads.items():
            content = RecordDict({HEADER: header})
            put_packed(content, PAYLOAD, payload if packed else pack(payload))
            outgoing.append(Message(content, dst_node_id=target if by_node else self.nodes[target],
                                    message_type=kind, group_id=str(rnd)))
        replies = self.grid.send_and_receive(outgoing, timeout=self.timeout)
        sent = {message.metadata.message_id: target for message, target in zip(outgoing, payloads)}  # ids set on send
        answers, failed = {}, []
        for reply in replies:
            target = sent.get(reply.metadata.reply_to_message_id)
            if target is None:
                continue
            if reply.has_error():
                failed.append((target, reply.error.reason))
                continue
            answers[target] = take(reply.content, PAYLOAD)
        missing = [target for target in payloads if target not in answers]
        if missing:
            log.warning("round %d %s: no answer from %s %s%s", rnd, op, "node" if by_node else "client", missing,
                        f" (errors: {failed})" if failed else f" within {self.timeout:.0f} s")
        return answers


def serve(grid: Grid, config: Config, quiet: bool = True):
    """Run `config` with the clients on Flower nodes; writes a run directory as `pfedkit run` does
    (config.yaml, partition.npz, metrics.csv, summary.json, clients.npz; no checkpoint)."""
    from pfedkit import build, runs
    from pfedkit.data.federated import build_federated
    from pfedkit.federation import config_dataset, split_plan
    from pfedkit.flower.checks import check_flower_config

    check_flower_config(config)  # also for an app started by hand (flwr run)
    dataset = config_dataset(config)
    data = build_federated(split_plan(config), dataset, build.uses_channels_last(config, dataset.input_shape))
    algorithm, _ = build.build_algorithm(config, data.input_shape, data.num_classes, data.train_counts())
    clients = FlowerClients(grid, config, asks_reports=algorithm.has_client_report())
    # The nodes' count (node.py decides it alike): the server's hooks compute with it too.
    simulation = build.simulation_for(config, algorithm, data, None, build.run_threads(config, side_by_side=True),
                                      clients)
    ops = algorithm.setup.ops
    state = simulation.initial_state(ops.initial_params(), ops.initial_buffers())
    context = runs.Prepared(data, simulation, state, clients, resumable=False, backend="flower")
    return runs.execute(config, context, runs.start_run_dir(config, data), quiet=quiet)
