"""The ClientApp side: one Flower node is one pfedkit client.

A node learns which client it is from its `node_config["partition-id"]` and the run's config
from every message the server sends (so a fresh ClientApp process, as in a deployment, needs
nothing else). It builds what the in-process simulation builds for that client: the partition
(from the dataset's labels, so it matches the server's), its own train/test tensors only, the
algorithm and a sequential trainer on the node's `device` (resolved on the node's machine:
`auto` is its GPU when torch sees one, else its CPU; `cuda` on a node without one is refused in
one line). It then runs the very same client math as the simulation,
through `LocalClients` with a one-client state: `client_report`, `client_update` (its `Fit`
requests answered by the same `LocalTrainer`) and the evaluation.

What the client keeps between rounds (the algorithm's client state, its BatchNorm statistics,
kept optimizer state, and its trained model for `eval_point=after_local_training`) lives in the
node's `context.state`, packed as records. The node logs the device it trains on when it builds
its client, and every train answer names it (`device`), which the server logs once per client.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import Context, Message, RecordDict

from pfedkit.config import Config
from pfedkit.core.threads import compute_threads
from pfedkit.data.federated import client_data, split_indices
from pfedkit.data.partition import class_counts
from pfedkit.engine.device import describe_device, resolve_device
from pfedkit.engine.runtimes.sequential import SequentialRuntime
from pfedkit.engine.local_clients import LocalClients
from pfedkit.engine.state import SimState
from pfedkit.federation import config_dataset, split_plan
from pfedkit.flower.records import put, take

HEADER = "pfedkit"  # the ConfigRecord every server message carries: op, round, config
PAYLOAD = "payload"
STATE = "client"    # the node's context.state entry

log = logging.getLogger("pfedkit.flower")


@dataclass
class NodeClient:
    """Everything one node builds once per (config, client) in a process."""
    cid: int
    config: Config
    clients: LocalClients
    initial: dict[str, Any]  # the client's starting state, buffers and optimizer state
    threads: int  # what it computes with (`build.run_threads`): its trainer and every hook alike
    device: torch.device = torch.device("cpu")  # where this node trains and evaluates
    device_name: str = "cpu"  # `describe_device(device)`: what the node reports


def build_node(config: Config, cid: int) -> NodeClient:
    from pfedkit.build import build_algorithm, run_threads, train_settings, uses_channels_last

    device = resolve_device(config.device, "sequential")  # this machine's: a node is one sequential trainer
    dataset = config_dataset(config)
    if not 0 <= cid < config.num_clients:
        raise ValueError(f"partition-id {cid} is outside the run's clients 0..{config.num_clients - 1}")
    train_index, test_index = split_indices(split_plan(config), dataset)
    counts = class_counts(list(train_index), dataset.y, dataset.num_classes)
    channels_last = uses_channels_last(config, dataset.input_shape)
    own = {cid: client_data(dataset, cid, train_index[cid], test_index[cid], counts[cid], channels_last)}
    algorithm, archs = build_algorithm(config, dataset.input_shape, dataset.num_classes, counts)
    node_data = _NodeData(dataset.num_classes, own)
    threads = run_threads(config, side_by_side=True)  # nodes share machines like a backend's workers
    runtime = SequentialRuntime(archs.build, train_settings(config), node_data, threads=threads,
                                builds=archs.builds, model_keys=archs.model_keys, device=device)
    ops = algorithm.setup.ops_for(cid)
    params = ops.initial_params()
    initial = {"client": algorithm.init_client(cid, params), "buffers": ops.initial_buffers(), "optimizer": {},
               "trained": None, "trained_round": -1}
    name = describe_device(device)
    log.info("client %d trains on %s", cid, name)
    return NodeClient(cid, config, LocalClients(algorithm, own, runtime, dataset.num_classes, config.eval_point),
                      initial, threads, device, name)


@dataclass(frozen=True)
class _NodeData:
    """The part of FederatedData a node's runtime reads: its own client only."""
    num_classes: int
    clients: dict


_NODES: dict[tuple[str, int], NodeClient] = {}  # per process: a simulation's actor serves many nodes


def node_for(config_text: str, cid: int, data_dir: str | None) -> NodeClient:
    key = (config_text, cid)
    if key not in _NODES:
        settings = json.loads(config_text)
        if data_dir:  # each machine's own data directory wins over the server's
            settings["data_dir"] = data_dir
        if len(_NODES) > 64:
            _NODES.clear()
        _NODES[key] = build_node(Config(**settings), cid)
    return _NODES[key]


def _one_client_state(node: NodeClient, stored: dict[str, Any], server: Any = None) -> SimState:
    keep = node.config.keep_optimizer_state
    return SimState(0, server, {node.cid: stored["client"]}, {node.cid: stored["buffers"]},
                    optimizer_states={node.cid: stored["optimizer"]} if keep else [])


def handle(msg: Message, context: Context) -> Message:
    """Answer one server message (`op` in its header): identify, report, train or evaluate."""
    header = msg.content[HEADER]
    op, rnd = str(header["op"]), int(header["round"])
    cid = int(context.node_config["partition-id"])
    if op == "identify":
        return _reply(msg, {"partition_id": cid})
    node = node_for(str(header["config"]), cid, context.node_config.get("data-dir"))
    stored = take(context.state, STATE) or dict(node.initial)
    payload = take(msg.content, PAYLOAD)
    with compute_threads(node.threads):
        answer = OPERATIONS[op](node, rnd, stored, payload)
    put(context.state, STATE, stored)
    return _reply(msg, answer)


def _report(node: NodeClient, rnd: int, stored: dict, payload: Any) -> Any:
    return node.clients.reports(rnd, [node.cid], _one_client_state(node, stored)).get(node.cid)


def _train(node: NodeClient, rnd: int, stored: dict, message: Any) -> dict[str, Any]:
    state = _one_client_state(node, stored)
    replies = {}
    stats = node.clients.train(rnd, {node.cid: message}, [node.cid], state, replies.__setitem__)
    stored.update(client=state.clients[node.cid], buffers=state.buffers[node.cid])
    if state.optimizer_states:
        stored["optimizer"] = state.optimizer_states[node.cid]
    mine = stats[node.cid]
    if node.config.eval_point == "after_local_training":  # evaluated after the round's aggregation
        stored.update(trained=mine.get("trained"), trained_round=rnd)
    return {"reply": replies[node.cid], "loss": mine["loss"], "steps": mine["steps"], "samples": mine["samples"],
            "device": node.device_name}


def _evaluate(node: NodeClient, rnd: int, stored: dict, server: Any) -> dict[str, Any]:
    state = _one_client_state(node, stored, server)
    stats = {node.cid: {"trained": stored["trained"]}} if stored["trained_round"] == rnd else {}
    evals, norms = node.clients.evaluate(rnd, [node.cid], state, stats)
    ev = evals[node.cid]
    return {"correct": ev.correct, "n_test": ev.n_test, "loss_sum": ev.loss_sum,
            "class_correct": ev.class_correct, "class_total": ev.class_total, "norms": norms[node.cid]}


OPERATIONS = {"report": _report, "train": _train, "evaluate": _evaluate}


def _reply(msg: Message, answer: Any) -> Message:
    content = RecordDict()
    put(content, PAYLOAD, answer)
    return Message(content, reply_to=msg)
