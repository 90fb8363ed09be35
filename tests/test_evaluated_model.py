"""Every algorithm evaluates the model assembled from the right parts (issue 22).

A run of two rounds on the embedded digits set is recorded at the engine's seams, not read from
the algorithm's own bookkeeping: each Fit request and the trainer's answer (what a client
trained), each client_update's download and returned state, the server state after every round,
and what the engine finally handed to the evaluator. From those parts and the algorithm's
documented rule (docs/algorithms/<name>.md, "Evaluated model"), a `Rule` assembles the model each
client should be evaluated with: e.g. FedPer = the body the server averaged in the last round +
the head the client's last Fit returned. Which rule is read off the class: `evaluated_model`
names one of the standard assemblies (`STANDARD_RULES`: "global", "own", "shared_body",
"shared_head"), so a method using one needs nothing here; "custom" means a rule of the method's
own in `CUSTOM_RULES`, under its name. The test then checks that

1. the engine evaluated exactly those parameters (tensor for tensor; with evaluation-time
   adaptation, the adaptation started from them),
2. the loss recorded in metrics.csv is the loss of that model (our own evaluation of it, with
   the algorithm's custom predict where it has one, and our own adaptation Fit where it adapts),
3. the test has power: the same rule fed wrong parts (the initial model, the server state the
   client downloaded before the last aggregation, the parts before the last local training, the
   previous round's training, and per algorithm a few more, e.g. PFedCS's teacher head) assembles
   other models, and each of those that differs from the right one gives another loss than the
   recorded one (the initial model always differs).

A client's trained parts come from the trainer's answers and averaged parts are recomputed from
them (FedAvg: the n_i-weighted mean, bit for bit as the engine's), never read from the state the
algorithm wrote, so an algorithm that stores (and then evaluates) a stale head or body fails here.
What only the server computes (FedReMa's peer selection, cwFedAvg's class-wise models, CReFF's
re-trained classifier, cluster models, prototypes) is read from the server state or the
diagnostics the algorithm recorded; the assembly around it is still checked.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import pfedkit
from pfedkit.algorithms import algorithm_names, get_algorithm
from pfedkit.algorithms.perfedavg import inner_step
from pfedkit.core.contract import EVALUATED_MODELS, Algorithm, Fit
from pfedkit.core.params import Params, interpolate, linear_layer_names, merge, select, weighted_mean
from pfedkit.engine.protocols import OnInputs
from pfedkit.engine.runtimes.sequential import SequentialRuntime
from pfedkit.engine.simulate import Simulation
from pfedkit.engine.trainer import FitJob, LocalTrainer
from pfedkit.models import MODELS, ModelInfo
from pfedkit.models.base import BodyHeadModel, head_start

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROUNDS = 2
NUM_CLIENTS = 4


class DigitsConvNet(BodyHeadModel):
    """8x8 digits through a small conv layer, then two FC layers: with FedReMa's head ("fc" = all
    fully connected layers) its body still has parameters, which the mlp's (a flatten) has not."""
    HEAD_SPLITS = {"last": "fc", "fc": "fc1"}

    def __init__(self, input_shape, num_classes: int, head: str = "last"):
        layers = [("image", nn.Unflatten(1, (1, 8, 8))), ("conv", nn.Conv2d(1, 4, 3)), ("relu0", nn.ReLU()),
                  ("flatten", nn.Flatten()), ("fc1", nn.Linear(4 * 6 * 6, 32)), ("relu1", nn.ReLU()),
                  ("fc", nn.Linear(32, num_classes))]
        super().__init__(layers, head_start(head, self.HEAD_SPLITS, "digits_conv"))


class DigitsBatchNormNet(BodyHeadModel):
    """The digits features through a hidden layer with BatchNorm (FedBN's local layers)."""
    HEAD_SPLITS = {"last": "fc"}

    def __init__(self, input_shape, num_classes: int, head: str = "last"):
        layers = [("fc1", nn.Linear(64, 32)), ("bn1", nn.BatchNorm1d(32)), ("relu1", nn.ReLU()),
                  ("fc", nn.Linear(32, num_classes))]
        super().__init__(layers, head_start(head, self.HEAD_SPLITS, "digits_bn"))


# (algorithm, config changes): every algorithm on the digits mlp, and a few seed-method settings
# the default run does not reach.
CASES = [pytest.param(name, {}, id=name) for name in algorithm_names()] + [
    pytest.param("fedrema", {"model": "digits_conv"}, id="fedrema-conv-body"),
    pytest.param("fedrema", {"model": "digits_conv", "fedrema": {"variant": "A"}}, id="fedrema-conv-body-A"),
    pytest.param("pfedcs", {"pfedcs": {"beta": 1}}, id="pfedcs-stage2"),
    pytest.param("pfedcs", {"pfedcs": {"rho": 0}}, id="pfedcs-no-finetuning"),
    pytest.param("rpfedpm", {"rpfedpm": {"relation_detach_body": True}}, id="rpfedpm-detached"),
    *([pytest.param("rpfedpm", {"rpfedpm": {"relation_training": "alternate"}}, id="rpfedpm-alternate")]
      if "relation_training" in get_algorithm("rpfedpm").Hyper.model_fields else []),
    pytest.param("cwfedavg", {"cwfedavg": {"mix_on": "client"}}, id="cwfedavg-mix-on-client"),
    pytest.param("fedbn", {"model": "digits_bn"}, id="fedbn-batchnorm"),
    pytest.param("fedem", {"model": "digits_bn"}, id="fedem-batchnorm"),
    pytest.param("pfedfda", {"pfedfda": {"evaluate_with": "global_body", "fixed_beta": 1.0}},
                 id="pfedfda-global-body"),
]


# ---------------------------------------------------------------------------------------------
# Recording a run at the engine's seams


@dataclass
class Recording:
    algorithm: Algorithm | None = None
    runtime: SequentialRuntime | None = None
    initial_params: Params | None = None
    servers: dict[int, Any] = field(default_factory=dict)        # round -> server state after it (0: initial)
    clients: dict[int, list[Any]] = field(default_factory=dict)  # round -> client states after it
    downloads: dict[tuple[int, int], Any] = field(default_factory=dict)  # (round, cid) -> message
    fits: dict[tuple[int, int], list[tuple[Fit, Params]]] = field(default_factory=dict)  # -> [(request, answer)]
    adapted: dict[tuple[int, int], tuple[Fit, Params]] = field(default_factory=dict)
    evaluated: dict[tuple[int, int], tuple[Params, Any]] = field(default_factory=dict)  # -> (params, buffers)


def recorded_run(algorithm: str, tmp_path, monkeypatch, changes: dict) -> tuple:
    """Run `algorithm` for ROUNDS rounds with every seam recorded -> (Recording, Result)."""
    rec = Recording()
    monkeypatch.setitem(MODELS, "digits_conv", ModelInfo("digits_conv", DigitsConvNet, "test model"))
    monkeypatch.setitem(MODELS, "digits_bn", ModelInfo("digits_bn", DigitsBatchNormNet, "test model"))
    patch_simulation(monkeypatch, rec)
    patch_trainer(monkeypatch, rec)
    patch_evaluation(monkeypatch, rec)
    changes = dict(changes)
    # the class's quick_test_options keep each run under a second or two on the embedded data
    section = {**get_algorithm(algorithm).quick_test_options, **changes.pop(algorithm, {})}
    result = pfedkit.run({
        "algorithm": algorithm, "dataset": "digits", "num_clients": NUM_CLIENTS, "rounds": ROUNDS,
        "join_ratio": 1.0, "threads": 1, "batch_size": 50, "lr": 0.05, "seed": 3, "backend": "sequential",
        "device": "cpu", "client_states": "memory", "out_dir": str(tmp_path / "runs"),
        "partition": {"scheme": "dirichlet", "alpha": 0.5}, **({algorithm: section} if section else {}), **changes})
    return rec, result


def patch_simulation(monkeypatch, rec: Recording) -> None:
    initial_state, run_round = Simulation.initial_state, Simulation.run_round

    def recording_initial_state(self, params, buffers, *args, **kwargs):
        state = initial_state(self, params, buffers, *args, **kwargs)
        rec.algorithm, rec.initial_params = self.algorithm, copy.deepcopy(params)
        rec.servers[0], rec.clients[0] = copy.deepcopy(state.server), copy.deepcopy(list(state.clients))
        trace_client_updates(monkeypatch, rec, self.algorithm)
        return state

    def recording_run_round(self, state):
        report = run_round(self, state)
        rec.servers[state.round] = copy.deepcopy(state.server)
        rec.clients[state.round] = copy.deepcopy(list(state.clients))
        return report

    monkeypatch.setattr(Simulation, "initial_state", recording_initial_state)
    monkeypatch.setattr(Simulation, "run_round", recording_run_round)


def trace_client_updates(monkeypatch, rec: Recording, algorithm: Algorithm) -> None:
    """Record what each client downloads (the message its client_update is called with)."""
    update = algorithm.client_update

    def traced(rnd, cid, client, message, data):
        rec.downloads[rnd, cid] = message
        return update(rnd, cid, client, message, data)

    monkeypatch.setattr(algorithm, "client_update", traced)


def patch_trainer(monkeypatch, rec: Recording) -> None:
    fit = LocalTrainer.fit

    def recording_fit(self, job: FitJob, x, y):
        outcome = fit(self, job, x, y)
        if job.purpose == "adapt":
            rec.adapted[job.rnd, job.cid] = (job.request, outcome.params)
        else:
            rec.fits.setdefault((job.rnd, job.cid), []).append((job.request, outcome.params))
        return outcome

    monkeypatch.setattr(LocalTrainer, "fit", recording_fit)


def patch_evaluation(monkeypatch, rec: Recording) -> None:
    evaluate_many = SequentialRuntime.evaluate_many

    def recording_evaluate_many(self, items):
        rec.runtime = self
        rnd = max(rec.servers) + 1  # evaluation runs inside the round, before it is recorded
        for cid, params, buffers, _ in items:
            rec.evaluated[rnd, cid] = (params, buffers)
        return evaluate_many(self, items)

    monkeypatch.setattr(SequentialRuntime, "evaluate_many", recording_evaluate_many)


# ---------------------------------------------------------------------------------------------
# The parts a rule assembles from


@dataclass
class Parts:
    """What the model of each client is assembled from, after the last round R (every client
    takes part in every round here). `trained(cid, k)`: the trainer's answer to the client's k-th
    Fit of round R (k = -1: the last); `request(cid, k)`: that Fit's starting parameters."""
    rec: Recording
    server: Any             # the server state the client's evaluation may read (after round R)
    clients: list[Any]      # the client states (after round R)
    trained: Callable[[int, int], Params]
    request: Callable[[int, int], Fit]
    download: Callable[[int], Any]
    before: list[Any]       # the client states at the start of round R
    sizes: list[int]

    @property
    def algorithm(self) -> Algorithm:
        return self.rec.algorithm

    @property
    def initial(self) -> Params:
        return self.rec.initial_params

    def diagnostic(self, key: str, rnd: int = ROUNDS) -> Any:
        return self.rec.algorithm.diagnostics[key][rnd]


def true_parts(rec: Recording, sizes: list[int]) -> Parts:
    return Parts(rec, rec.servers[ROUNDS], rec.clients[ROUNDS],
                 trained=lambda cid, k=-1: rec.fits[ROUNDS, cid][k][1],
                 request=lambda cid, k=-1: rec.fits[ROUNDS, cid][k][0],
                 download=lambda cid: rec.downloads[ROUNDS, cid], before=rec.clients[ROUNDS - 1], sizes=sizes)


def wrong_parts(parts: Parts) -> dict[str, Parts]:
    """The same parts with one kind replaced by a stale or initial one: what a wrong assembly uses.
    Tensors trained beside the model (`Fit.extra`: APFL's v_i, FedRoD's personal head, R-pFedPM's
    psi...) go stale with the model's."""
    rec = parts.rec

    def initial(cid: int, k: int = -1) -> Params:  # extras as the client's first Fit of the run got them
        first = rec.fits[1, cid][0][0]
        return {**rec.fits[ROUNDS, cid][k][1], **first.extra, **rec.initial_params}

    def started_from(first: int | None) -> Callable[[int, int], Params]:
        """The starting point of Fit `first` of round R (None: of the Fit asked for)."""
        def trained(cid: int, k: int = -1) -> Params:
            request = rec.fits[ROUNDS, cid][k if first is None else first][0]
            return {**rec.fits[ROUNDS, cid][k][1], **request.params, **request.extra}
        return trained

    return {
        "the initial model": replace(parts, server=rec.servers[0], trained=initial),
        "the server state the client downloaded (before the last aggregation)":
            replace(parts, server=rec.servers[ROUNDS - 1]),
        "the parts before the Fit they come from": replace(parts, trained=started_from(None)),
        "the parts before the round's first Fit": replace(parts, trained=started_from(0)),
        "the parts trained in the previous round": replace(
            parts, trained=lambda cid, k=-1: rec.fits[ROUNDS - 1, cid][k][1]),
    }


def psi_of(state: dict) -> dict:
    """R-pFedPM's relation module (and its BatchNorm statistics) kept in a client state."""
    return {"relation": state["relation"], "relation_stats": state["relation_stats"]}


# ---------------------------------------------------------------------------------------------
# What each algorithm evaluates (its documented rule), from those parts


@dataclass
class Expected:
    params: Params
    server: Any = None   # the states a custom `predict` reads (None: the final ones)
    client: Any = None
    adapt: Fit | None = None  # the evaluation-time adaptation Fit (its params: `params`)
    # the rule's own prediction from the inputs, (server, client, buffers, x) -> logits, for a method
    # with `predict_inputs` (None: the algorithm's hook, fed the expected states)
    predict_inputs: Callable[[Any, Any, Any, torch.Tensor], torch.Tensor] | None = None


def averaged(parts: Parts, part: str = "all") -> Params:
    """The sample-weighted mean (FedAvg) of `part` of the models the clients' last Fits returned:
    what the server's aggregation of the last round must hold (every client takes part)."""
    return weighted_mean([select(model_only(parts.trained(j, -1)), part) for j in range(NUM_CLIENTS)], parts.sizes)


def global_model(parts: Parts, cid: int) -> Expected:
    """FedAvg-like: the mean of the round's trained models, weighted by n_i."""
    return Expected(averaged(parts))


def last_trained(parts: Parts, cid: int) -> Expected:
    """The client's own model as its last Fit returned it (Local, DA-PFL, FedAMP, FeSEM...)."""
    return Expected(model_only(parts.trained(cid, -1)))


def model_only(params: Params) -> Params:
    return {name: value for name, value in params.items() if name.startswith(("body.", "head."))}


def shared_and_private(shared: str) -> Callable[[Parts, int], Expected]:
    """FedPer / FedRep (shared body) and LG-FedAvg (shared head): the averaged shared part + the
    private part the client's last Fit returned."""
    private = "head" if shared == "body" else "body"

    def rule(parts: Parts, cid: int) -> Expected:
        return Expected(merge(averaged(parts, shared), select(parts.trained(cid, -1), private)))
    rule.__name__ = f"shared_{shared}_and_private_{private}"
    rule.__doc__ = f"The mean of the round's trained {shared} parts + the {private} of the client's last Fit."
    return rule


def ditto(parts: Parts, cid: int) -> Expected:
    """The personal model v_i: the answer to the first Fit (the second trains the global model)."""
    return Expected(parts.trained(cid, 0))


def apfl(parts: Parts, cid: int) -> Expected:
    """alpha_i v_i + (1 - alpha_i) w with v_i, alpha_i from the last Fit and w the FedAvg of the trained w_j."""
    trained, w = parts.trained(cid, -1), averaged(parts)
    alpha = float(trained["alpha"])
    personal = {name: trained["personal." + name] for name in w}
    return Expected(interpolate(w, personal, alpha))


def fedphp(parts: Parts, cid: int) -> Expected:
    """The inherited model: v = w_1 after round 1, then v <- mu_t v + (1 - mu_t) w_t with mu_t =
    min(m (t - 1) / T, m) (every client takes part in every round, so both schedules give this),
    w_t the model the client's Fit of round t returned; evaluate_with=local: w_R itself."""
    hyper, trained = parts.algorithm.hyper, model_only(parts.trained(cid, -1))
    if hyper.evaluate_with == "local":
        return Expected(trained)
    inherited = model_only(parts.rec.fits[1, cid][-1][1])
    for rnd in range(2, ROUNDS + 1):
        latest = trained if rnd == ROUNDS else model_only(parts.rec.fits[rnd, cid][-1][1])
        mu = min(hyper.momentum * (rnd - 1) / ROUNDS, hyper.momentum)
        inherited = interpolate(latest, inherited, mu)
    return Expected(inherited)


def apple(parts: Parts, cid: int) -> Expected:
    """sum_j p_ij w_j in client order: p_i and the own core w_i as the last Fit returned them, the
    other cores as the client downloaded them (its Fit's "core<j>." extras)."""
    trained = parts.trained(cid, -1)
    return Expected(dr_mixture(trained, lambda j: {name[len(f"core{j}."):]: value for name, value in trained.items()
                                                   if name.startswith(f"core{j}.")}, cid))


def dr_mixture(trained: Params, others: Callable[[int], Params], cid: int) -> Params:
    """APPLE's sum_j p_j w_j with p and the own core from `trained`, the other cores from `others`."""
    from pfedkit.core.params import WeightedSum

    total, p = WeightedSum(), trained["dr"]
    for j in range(NUM_CLIENTS):
        total.add(model_only(trained) if j == cid else others(j), float(p[j]))
    return total.total


def apple_wrong(parts: Parts) -> dict[str, Callable[[int], Expected]]:
    return {"the other clients' cores as the server holds them after the round (not as downloaded)":
            lambda cid: Expected(dr_mixture(parts.trained(cid, -1), lambda j: parts.server["cores"][j], cid))}


def perfedavg(parts: Parts, cid: int) -> Expected:
    """The global model (FedAvg of the trained models), adapted by the unclipped inner step, lr alpha."""
    params = averaged(parts)
    return Expected(params, adapt=Fit(params, steps=1, lr=parts.algorithm.hyper.alpha, step=inner_step))


def fedbabu(parts: Parts, cid: int) -> Expected:
    """Global body (FedAvg of the trained bodies) + the fixed initial head, fine-tuned for finetune_epochs."""
    params, h = merge(averaged(parts, "body"), select(parts.initial, "head")), parts.algorithm.hyper
    return Expected(params, adapt=Fit(params, trainable=h.finetune_part, epochs=h.finetune_epochs))


def fedavgft(parts: Parts, cid: int) -> Expected:
    """The global model (FedAvg of the trained models), fine-tuned finetune_steps mini-batches (or
    finetune_epochs epochs when set) at finetune_lr."""
    params, h = averaged(parts), parts.algorithm.hyper
    length = {"steps": h.finetune_steps} if h.finetune_epochs is None else {"epochs": h.finetune_epochs}
    return Expected(params, adapt=Fit(params, trainable=h.finetune_part, lr=h.finetune_lr, **length))


def fedbn(parts: Parts, cid: int) -> Expected:
    """The mean of the trained models except the BatchNorm layers' weights and biases (found by
    module type in the run's model), which are the client's own from its last Fit."""
    template = parts.algorithm.setup.ops.template
    local = {f"{layer_name}.{name}" for layer_name, layer in template.named_modules()
             if isinstance(layer, nn.modules.batchnorm._BatchNorm) for name, _ in layer.named_parameters()}
    own, mean = model_only(parts.trained(cid, -1)), averaged(parts)
    return Expected({name: own[name] if name in local else value for name, value in mean.items()})


def fedrod(parts: Parts, cid: int) -> Expected:
    """Global body + (generic head + the personal head of the last Fit): W_G + W_P, b_G + b_P."""
    params, trained = averaged(parts), parts.trained(cid, -1)
    personal = {name: value for name, value in trained.items() if name.startswith("personal")}
    weight_name, bias_name = linear_layer_names(select(params, "head"), "head")
    params[weight_name] = params[weight_name] + next(v for v in personal.values() if v.dim() == 2)
    params[bias_name] = params[bias_name] + next(v for v in personal.values() if v.dim() == 1)
    return Expected(params)


def l2gd(parts: Parts, cid: int) -> Expected:
    """x_i: the last local training, or its mix towards the mean on an aggregation round."""
    message = parts.download(cid)
    if "mean" not in message:
        return last_trained(parts, cid)
    return Expected(interpolate(parts.before[cid]["params"], message["mean"], parts.algorithm.hyper.theta))


def fedgh(parts: Parts, cid: int) -> Expected:
    """Own trained body + the head the server trained in the last round."""
    return Expected(merge(select(parts.trained(cid, -1), "body"), parts.server["head"]))


def creff(parts: Parts, cid: int) -> Expected:
    """FedAvg of the trained models with the server's re-trained classifier phi_re as head."""
    return Expected(merge(averaged(parts), parts.server["head_re"]))


def ccvr(parts: Parts, cid: int) -> Expected:
    """The body of the model the client downloaded in the last round (the aggregate of the round
    before) with the classifier the server calibrated in the last round (before any calibration:
    the server's model's)."""
    calibrated = parts.server.get("calibrated", parts.server["params"])
    return Expected(merge(select(parts.download(cid)["params"], "body"), select(calibrated, "head")))


def cfl(parts: Parts, cid: int) -> Expected:
    """The model of the client's cluster (server state: splits and cluster means are server math)."""
    return Expected(parts.server["models"][int(parts.server["membership"][cid])])


def ifca(parts: Parts, cid: int) -> Expected:
    """The cluster model the client chose at its last training (the one its last Fit started from)."""
    started = parts.request(cid, -1).params
    chosen = [k for k, model in enumerate(parts.download(cid)["models"]) if same_params(model, started)]
    return Expected(parts.server["models"][chosen[0]])


def fedpfa(parts: Parts, cid: int) -> Expected:
    """The client's group model; ungrouped: the federated (in phase 1 the global) model."""
    group = parts.server["assignment"].get(cid)
    return Expected(parts.server["params"] if group is None else parts.server["group_models"][group])


def fedpac(parts: Parts, cid: int) -> Expected:
    """Global body + the combined head: sum_j w_ij head_j over the round's trained heads."""
    weights = parts.diagnostic("fedpac_weights")[cid]
    cids = [j for j in range(len(weights)) if weights[j] != 0]
    head = weighted_mean([select(parts.trained(j, -1), "head") for j in cids], [weights[j] for j in cids])
    return Expected(merge(averaged(parts, "body"), head))


def fednh(parts: Parts, cid: int) -> Expected:
    """evaluate=global: the plain mean of the trained bodies + the server's prototypes mu as head
    weight (zero bias), scored by the server's mu and s (`evaluation_state`)."""
    server = parts.server
    body = weighted_mean([select(parts.trained(j, -1), "body") for j in range(NUM_CLIENTS)], [1.0] * NUM_CLIENTS)
    weight_name, bias_name = linear_layer_names(select(parts.initial, "head"), "head")
    head = {weight_name: server["prototypes"]}
    if bias_name is not None:
        head[bias_name] = torch.zeros(server["prototypes"].shape[0])
    return Expected(merge(body, head), server=server, client={"prototypes": server["prototypes"], "scale": server["scale"]})


def fedproto(parts: Parts, cid: int) -> Expected:
    """Own trained model; prediction by the nearest global prototype of the last aggregation."""
    params = model_only(parts.trained(cid, -1))
    return Expected(params, server=parts.server, client={"params": params})


def fedpcl(parts: Parts, cid: int) -> Expected:
    """Own trained model; prediction by the nearest local prototype: per class, the mean of the
    L2-normalised body outputs of that model on the client's training data."""
    params, data = model_only(parts.trained(cid, -1)), parts.rec.runtime.data.clients[cid]
    features = parts.algorithm.setup.ops.features(params, data.x_train, parts.rec.evaluated[ROUNDS, cid][1])
    features = torch.nn.functional.normalize(features.double(), dim=1)
    prototypes = torch.zeros(parts.algorithm.setup.num_classes, features.shape[1], dtype=torch.float64)
    for label in data.y_train.unique().tolist():
        prototypes[label] = features[data.y_train == label].mean(dim=0)
    present = torch.bincount(data.y_train, minlength=prototypes.shape[0]) > 0
    return Expected(params, client={"params": params, "prototypes": prototypes.float(), "present": present})


def pfedhn(parts: Parts, cid: int) -> Expected:
    """What the server's hypernetwork (after the last update) generates from the client's embedding:
    an MLP (ReLU between its Linear layers) on row cid of the table, one linear head per generated
    tensor; the rest (pFedHN-PC: the head) from the client's own state."""
    hn, linear = parts.server["hn"], torch.nn.functional.linear
    feature, layers = hn["embeddings"][cid], sum(1 for name in hn if name.startswith("mlp.") and name.endswith("weight"))
    for k in range(layers):
        feature = linear(feature, hn[f"mlp.{k}.weight"], hn[f"mlp.{k}.bias"])
        feature = torch.relu(feature) if k < layers - 1 else feature
    own = parts.clients[cid]["head"] if parts.clients[cid] else {}
    return Expected({name: own[name] if name in own else
                     linear(feature, hn[f"out.{name}.weight"], hn[f"out.{name}.bias"]).reshape(value.shape)
                     for name, value in parts.initial.items()})


def pfedla(parts: Parts, cid: int) -> Expected:
    """Client cid's mixture of every client's stored model (after the last update), one weight per
    client and module: its own hypernetwork's MLP (a ReLU after each Linear) on its embedding,
    then per module ReLU(W f + b), divided by its sum."""
    hn, models, linear = parts.server["hn"], parts.server["models"], torch.nn.functional.linear
    feature, depth = hn["embeddings"][cid], sum(1 for name in hn if name.startswith("mlp.") and name.endswith("weight"))
    for k in range(depth):
        feature = torch.relu(linear(feature, hn[f"mlp.{k}.weight"][cid], hn[f"mlp.{k}.bias"][cid]))
    mixed = {}
    for name in parts.initial:
        module = name.rsplit(".", 1)[0]
        weights = torch.relu(linear(feature, hn[f"out.{module}.weight"][cid], hn[f"out.{module}.bias"][cid]))
        weights = weights / weights.sum()
        mixed[name] = sum(weights[j] * models[name][j] for j in range(len(weights)))
    return Expected(mixed)


def rpfedpm(parts: Parts, cid: int) -> Expected:
    """Own trained model; prediction by the relation module psi trained in the client's last round
    against that round's class features (its mixed features, global ones where it has none)."""
    from pfedkit.algorithms.pfedpm import relation_class_features

    algorithm, params = parts.algorithm, model_only(parts.trained(cid, -1))
    received, mixed = algorithm.received_and_mixed(parts.before[cid], parts.download(cid))
    class_features, available = relation_class_features(*mixed, *received)
    client = {"params": params, "class_features": class_features, "available": available,
              **trained_relation(parts, cid)}
    return Expected(params, client=client)  # (predict reads no server state)


def trained_relation(parts: Parts, cid: int) -> dict[str, Params]:
    """psi and its BatchNorm statistics as the Fit that trained them returned them ("relation."
    extras); in a round where psi did not train (no class feature yet) as the round began."""
    carried = {name[len("relation."):]: value for name, value in parts.trained(cid, -1).items()
               if name.startswith("relation.")}
    if not carried:
        return psi_of(parts.before[cid])
    statistics = {name: carried.pop(name) for name in parts.before[cid]["relation_stats"]}
    return {"relation": carried, "relation_stats": statistics}


def pfedcs(parts: Parts, cid: int) -> Expected:
    """Global body + the head of the client's last Fit (stage 1: the KL-guided training of its own
    head, not the fine-tuned teacher of the first Fit), normalised logits."""
    params = merge(averaged(parts, "body"), select(parts.trained(cid, -1), "head"))
    return Expected(params, client={"head": select(params, "head")})


def fedrema(parts: Parts, cid: int) -> Expected:
    """Global body + the personalised head: during the CCP the sample-weighted mean of the
    trained heads of the peers MDS selected (eq. 7); after it, weights G[i, j] (eq. 10)."""
    algorithm, participants = parts.algorithm, list(range(NUM_CLIENTS))
    heads = [select(parts.trained(j, -1), "head") for j in participants]
    if parts.diagnostic("ccp_active"):
        chosen = [int(j) for j in parts.diagnostic("selected")[cid]]
        weights = [parts.sizes[j] if algorithm.hyper.peer_weighting == "samples" else 1.0 for j in chosen]
    else:
        dependency = algorithm.diagnostics["dependency_map"]
        row = dependency[max(dependency)][cid]
        chosen = [j for j in participants if row[j] > 0]
        weights = [float(row[j]) for j in chosen]
    return Expected(merge(averaged(parts, "body"), weighted_mean([heads[j] for j in chosen], weights)))


def cwfedavg(parts: Parts, cid: int) -> Expected:
    """Shared layers + sum_j p~_ij w_j^G, p~_i read off the output layer the client just trained (eq. 4, 7)."""
    from pfedkit.algorithms.cwfedavg import estimate_class_distribution, output_weight_name, personalised_model

    trained = parts.trained(cid, -1)
    mixing = estimate_class_distribution(trained[output_weight_name(trained)]).detach().double()
    shared = {name: value for name, value in averaged(parts).items() if name in parts.server["shared"]}
    return Expected({**shared, **personalised_model(parts.server["class_wise"], mixing)})


def qffl(parts: Parts, cid: int) -> Expected:
    """q-FedAvg's step from the downloaded w: w - sum_k F_k^q L (w - w_k) / sum_k (q F_k^{q-1} L^2 ||w - w_k||^2
    + L F_k^q), w_k the trained models, F_k (+1e-10) the losses the server recorded, uniform over clients."""
    hyper, losses = parts.algorithm.hyper, parts.diagnostic("qffl_loss")
    w = {name: value.double() for name, value in parts.download(cid)["params"].items()}
    numerator, denominator = {name: torch.zeros_like(value) for name, value in w.items()}, 0.0
    for j in range(NUM_CLIENTS):
        f = losses[j] + 1e-10
        trained = model_only(parts.trained(j, -1))
        gap = {name: hyper.lipschitz * (w[name] - trained[name].double()) for name in w}
        for name in w:
            numerator[name] += f ** hyper.q * gap[name]
        squared = sum(float((value ** 2).sum()) for value in gap.values())
        denominator += hyper.q * f ** (hyper.q - 1) * squared + hyper.lipschitz * f ** hyper.q
    return Expected({name: (w[name] - numerator[name] / denominator).float() for name in w})


def fedala(parts: Parts, cid: int) -> Expected:
    """The global model (FedAvg of the trained models) with its top layers mixed with the client's
    last trained model, theta_i + (theta - theta_i) ⊙ W (torch.lerp), W as the round's last ALA Fit
    (the one before the local training) returned it ("ala_weight." extras); W = 1 (the global
    model) when the client ran no ALA."""
    global_, local = averaged(parts), model_only(parts.trained(cid, -1))
    count = len(parts.rec.fits[ROUNDS, cid])
    ala = parts.trained(cid, count - 2) if count > 1 else {}
    weights = {name[len("ala_weight."):]: value for name, value in ala.items() if name.startswith("ala_weight.")}
    return Expected({**global_, **{name: torch.lerp(local[name], global_[name], w) for name, w in weights.items()}})


def feddbe(parts: Parts, cid: int) -> Expected:
    """The global model (FedAvg of the trained models) whose head reads h + z̄_i: bias b + W z̄_i,
    z̄_i the bias memory the client's last Fit returned ("dbe_memory" extra)."""
    params, memory = averaged(parts), parts.trained(cid, -1)["dbe_memory"]
    weight_name, bias_name = linear_layer_names(select(params, "head"), "head")
    params[bias_name] = params[bias_name] + params[weight_name] @ memory
    return Expected(params)


def fedcac(parts: Parts, cid: int) -> Expected:
    """Each tensor's critical entries (sensitivity |(after - before) ⊙ after| of the client's last
    training at least its int(tau n)-th largest value; at most 1e-10: the smallest value above
    1e-20) from the plain mean of the trained models of its collaborators (the recorded
    fedcac_collaborators row), the other entries from the FedAvg of the trained models."""
    tau, row = parts.algorithm.hyper.tau, parts.diagnostic("fedcac_collaborators")[cid]
    peers = [j for j in range(NUM_CLIENTS) if row[j] == 1]
    customised = weighted_mean([model_only(parts.trained(j, -1)) for j in peers], [1.0] * len(peers))
    global_, before, after = averaged(parts), parts.request(cid, -1).params, model_only(parts.trained(cid, -1))
    model = {}
    for name, value in after.items():
        sensitivity = ((value - before[name]) * value).abs()
        ranked, count = torch.sort(sensitivity.reshape(-1), descending=True).values, int(tau * value.numel())
        bound = float(ranked[count - 1]) if count else math.inf
        if bound <= 1e-10 and (ranked > 1e-20).any():
            bound = float(ranked[ranked > 1e-20].min())
        model[name] = torch.where(sensitivity >= bound, customised[name], global_[name])
    return Expected(model)


def gpfl(parts: Parts, cid: int) -> Expected:
    """Global body, CoV and GCE (FedAvg of the trained ones: the names the server shares) + the head
    of the client's last Fit; prediction through the valve with p_i from that GCE (its `predict`)."""
    names = list(parts.rec.servers[0]["shared"])
    shared = weighted_mean([{n: parts.trained(j, -1)[n] for n in names} for j in range(NUM_CLIENTS)], parts.sizes)
    head = select(parts.trained(cid, -1), "head")
    return Expected(merge(select(shared, "body"), head), server={"shared": shared}, client={"head": head})


def fedcp(parts: Parts, cid: int) -> Expected:
    """Global body, CPN and global head: the FedAvg of the uploads, each the trained body and CPN
    and a * trained head + (1 - a) * the global head it downloaded; + the head of the client's
    last Fit; prediction through the policy network (its `predict`)."""
    share, uploads = parts.algorithm.hyper.head_upload_share, []
    for j in range(NUM_CLIENTS):
        trained, received = parts.trained(j, -1), parts.download(j)["params"]
        weight_name, bias_name = linear_layer_names(select(trained, "head"), "head")
        upload = {n: trained[n] for n in received if not n.startswith("fedcp_head.")}
        upload["fedcp_head.weight"] = share * trained[weight_name] + (1.0 - share) * received["fedcp_head.weight"]
        upload["fedcp_head.bias"] = share * trained[bias_name] + (1.0 - share) * received["fedcp_head.bias"]
        uploads.append(upload)
    shared, head = weighted_mean(uploads, parts.sizes), select(parts.trained(cid, -1), "head")
    return Expected(merge(select(shared, "body"), head), server={"shared": shared}, client={"head": head})


def pfedfda(parts: Parts, cid: int) -> Expected:
    """Own trained body + the Bayes rule of the client's adaptive Gaussians (its state: computed on
    the client from its features) with its class priors: W = S~^-1 mu, b = -(mu ⊙ W) 1 / 2 + log pi,
    S~ = (1 - eps) S + eps tr(S)/d I, pi = (n_c / n + eps) normalised. `evaluate_with=global_body`
    (the authors'): the averaged body, predicting with the Bayes rule of Gaussians re-fitted on the
    client's training features under that body (beta fixed at 1: the local estimates)."""
    algorithm, client = parts.algorithm, parts.clients[cid]
    if algorithm.hyper.evaluate_with == "global_body":
        return pfedfda_global_body(parts, cid)
    head = bayes_head(parts, cid, client["means"], client["covariance"])
    return Expected(merge(select(parts.trained(cid, -1), "body"), head))


def bayes_head(parts: Parts, cid: int, means: torch.Tensor, covariance: torch.Tensor) -> Params:
    """The head W = S~^-1 mu, b = -(mu ⊙ W) 1 / 2 + log pi of the docstring above, client cid's priors."""
    eps, dim = parts.algorithm.hyper.eps, covariance.shape[0]
    weight = torch.linalg.solve((1 - eps) * covariance + eps * torch.trace(covariance) / dim * torch.eye(dim), means.T).T
    counts = torch.as_tensor(np.asarray(parts.algorithm.setup.train_counts[cid]), dtype=torch.float32)
    priors = counts / counts.sum() + eps
    bias = -0.5 * (means * weight).sum(dim=1) + (priors / priors.sum()).log()
    weight_name, bias_name = linear_layer_names(select(parts.initial, "head"), "head")
    return {weight_name: weight, bias_name: bias}


def pfedfda_global_body(parts: Parts, cid: int) -> Expected:
    from pfedkit.algorithms.pfedfda import COVARIANCE, MEANS

    assert parts.algorithm.hyper.fixed_beta == 1.0, "this rule computes beta = 1 (the local estimates) only"
    eps, shared = parts.algorithm.hyper.eps, parts.server["shared"]
    body = averaged(parts, "body")
    data, buffers = parts.rec.runtime.data.clients[cid], parts.rec.evaluated[ROUNDS, cid][1]
    features = parts.algorithm.setup.ops.features(body, data.x_train, buffers).reshape(data.n_train, -1)
    labels = data.y_train.long()
    counts = torch.bincount(labels, minlength=shared[MEANS].shape[0])
    own = counts > parts.algorithm.hyper.cv_folds  # a class's own mean needs more than K samples
    class_means = torch.stack([features[labels == c].mean(dim=0) if own[c] else shared[MEANS][c]
                               for c in range(len(counts))])
    centred = features - class_means[labels]
    covariance = centred.T @ centred / (len(features) - 1) + eps + torch.eye(features.shape[1])
    head = bayes_head(parts, cid, class_means, covariance)
    return Expected(merge(body, bayes_head(parts, cid, shared[MEANS], shared[COVARIANCE])), client={"head": head})


def pfedfda_wrong(parts: Parts) -> dict[str, Callable[[int], Expected]]:
    """own_body: the authors evaluate the head with the averaged body, here the client's own body
    is. global_body: the global Gaussians' head without the re-fit, or the re-fitted head on the
    client's own trained body."""
    if parts.algorithm.hyper.evaluate_with == "global_body":
        def unfitted(cid: int) -> Expected:
            right = pfedfda(parts, cid)
            return replace(right, client={"head": select(right.params, "head")})

        def own_body(cid: int) -> Expected:
            right = pfedfda(parts, cid)
            return replace(right, params=merge(select(parts.trained(cid, -1), "body"), select(right.params, "head")))
        return {"the global Gaussians' head, not re-fitted": unfitted, "the client's own trained body": own_body}
    return {"the averaged body": lambda cid: Expected(merge(averaged(parts, "body"), select(pfedfda(parts, cid).params, "head")))}


def knnper(parts: Parts, cid: int) -> Expected:
    """The global model (FedAvg of the trained models), predicting with the client's datastore: the
    embeddings of its training set under that same model (with the buffers it is evaluated with),
    the training labels, and that model's head."""
    data, buffers = parts.rec.runtime.data.clients[cid], parts.rec.evaluated[ROUNDS, cid][1]
    params = averaged(parts)
    keys = parts.algorithm.setup.ops.features(params, data.x_train, buffers)
    return Expected(params, client={"params": params, "keys": keys, "labels": data.y_train})


def knnper_wrong(parts: Parts) -> dict[str, Callable[[int], Expected]]:
    def memory_of(model: Callable[[int], Params]) -> Callable[[int], Expected]:
        def assemble(cid: int) -> Expected:
            right, data = knnper(parts, cid), parts.rec.runtime.data.clients[cid]
            keys = parts.algorithm.setup.ops.features(model(cid), data.x_train, parts.rec.evaluated[ROUNDS, cid][1])
            return with_client(right, keys=keys)
        return assemble

    def no_memory(cid: int) -> Expected:
        right = knnper(parts, cid)
        return with_client(right, keys=right.client["keys"][:0], labels=right.client["labels"][:0])

    return {"no datastore (the global model alone)": no_memory,
            "a datastore built with the model downloaded in the last round": memory_of(
                lambda cid: parts.download(cid)["params"]),
            "a datastore built with the client's trained model": memory_of(lambda cid: parts.trained(cid, -1))}


def floco(parts: Parts, cid: int) -> Expected:
    """The n_i-weighted mean of the trained models and simplex vertices, with the output weight at
    the client's point beta_i of the simplex (server math: read from the server state), or at the
    centre before the projection: sum_m beta_m W_m, W_0 the output weight, W_m the "vertex.m" extras."""
    mean = weighted_mean([parts.trained(j, -1) for j in range(NUM_CLIENTS)], parts.sizes)
    count = parts.algorithm.hyper.num_endpoints
    names = [linear_layer_names(select(parts.initial, "head"), "head")[0]] + [f"vertex.{m}" for m in range(1, count)]
    points = parts.server["points"]
    beta = [1.0 / count] * count if points is None or np.isnan(points[cid]).any() else [float(b) for b in points[cid]]
    weight = beta[0] * mean[names[0]]
    for b, name in zip(beta[1:], names[1:]):
        weight = weight + b * mean[name]
    return Expected({**model_only(mean), names[0]: weight})


def floco_wrong(parts: Parts) -> dict[str, Callable[[int], Expected]]:
    def at_centre(cid: int) -> Expected:
        return floco(replace(parts, server={**parts.server, "points": None}), cid)
    return {"the output weight at the centre of the simplex instead of the client's point": at_centre}


def superfed(parts: Parts, cid: int) -> Expected:
    """After a mixing round: (1 - lam_eval) w_f + lam_eval w_l with w_f the FedAvg of the trained
    federated models and w_l the client's personal model ("personal." extras of its last Fit);
    before (no personal extras in the Fit): the federated model."""
    trained, federated = parts.trained(cid, -1), averaged(parts)
    if "personal." + next(iter(federated)) not in trained:
        return Expected(federated)
    personal = {name: trained["personal." + name] for name in federated}
    return Expected(interpolate(federated, personal, parts.algorithm.hyper.eval_lambda))


def pfedsim(parts: Parts, cid: int) -> Expected:
    """During the warm-up the FedAvg of the trained models; after it the client's own model as its
    last Fit returned it (the server stores it; the download mixed only its body)."""
    if parts.algorithm.warming_up(ROUNDS):
        return Expected(averaged(parts))
    return Expected(model_only(parts.trained(cid, -1)))


def fedem(parts: Parts, cid: int) -> Expected:
    """The mixture sum_k pi_ik softmax(h_k(x)) of the K components, each the n_i-weighted mean of
    the clients' k-th trained models, with pi_i = the mean over the client's training samples of
    the responsibilities pi_ik exp(-l_k) / sum_k' pi_ik' exp(-l_k') under the components it
    downloaded (in eval mode with its BatchNorm statistics as the round began), its pi before the
    round as the prior; the mixture with the evaluated statistics; the recorded parameters: the
    component of largest pi_ik."""
    count, ops = parts.algorithm.hyper.num_components, parts.algorithm.setup.ops
    components = [weighted_mean([model_only(parts.trained(j, k)) for j in range(NUM_CLIENTS)], parts.sizes)
                  for k in range(count)]
    data = parts.rec.runtime.data.clients[cid]
    buffers = parts.rec.evaluated[ROUNDS - 1, cid][1]  # the client's statistics as the round began
    losses = torch.stack([nn.functional.cross_entropy(ops.logits(c, data.x_train, buffers).double(), data.y_train,
                                                      reduction="none") for c in parts.download(cid)["components"]])
    log_joint = torch.log(parts.before[cid]["pi"].double())[:, None] - losses
    pi = (log_joint - torch.logsumexp(log_joint, dim=0)).exp().mean(dim=1)
    return Expected(components[int(torch.argmax(pi))], server={"components": components}, client={"pi": pi},
                    predict_inputs=partial(probability_mixture, ops))


def probability_mixture(ops, server: dict, client: dict, buffers, x: torch.Tensor) -> torch.Tensor:
    """log sum_k pi_k softmax(h_k(x)), each component with the evaluated BatchNorm statistics."""
    probabilities = sum(float(pi_k) * torch.softmax(ops.logits(c, x, buffers).double(), dim=1)
                        for pi_k, c in zip(client["pi"], server["components"]))
    return torch.log(probabilities)


def fedem_wrong(parts: Parts) -> dict[str, Callable[[int], Expected]]:
    def with_pi(cid: int, pi: torch.Tensor) -> Expected:
        return with_client(fedem(parts, cid), pi=pi)
    count = parts.algorithm.hyper.num_components
    return {"the mixture weights before the round's E-step": lambda cid: with_pi(cid, parts.before[cid]["pi"]),
            "uniform mixture weights": lambda cid: with_pi(cid, torch.full((count,), 1.0 / count, dtype=torch.float64)),
            "the first component alone": lambda cid: with_pi(cid, torch.eye(count, dtype=torch.float64)[0])}


def downloaded_model(parts: Parts) -> dict[str, Callable[[int], Expected]]:
    """A method evaluating the client's own model: the model it downloaded is wrong (where it downloads one)."""
    return {"the downloaded model": lambda cid: Expected(parts.download(cid)["params"])}


def fedbn_wrong(parts: Parts) -> dict[str, Callable[[int], Expected]]:
    return {"the averaged BatchNorm layers (FedAvg's model)": lambda cid: global_model(parts, cid)}


def ccvr_wrong(parts: Parts) -> dict[str, Callable[[int], Expected]]:
    calibrated = select(parts.server["calibrated"], "head")
    return {"the last aggregate, uncalibrated (FedAvg's model)": lambda cid: global_model(parts, cid),
            "the last aggregate's body with the calibrated classifier":
            lambda cid: Expected(merge(averaged(parts, "body"), calibrated)),
            "the downloaded model, uncalibrated": lambda cid: Expected(parts.download(cid)["params"])}


def ditto_wrong(parts: Parts) -> dict[str, Callable[[int], Expected]]:
    return {"the global model instead of the personal one": lambda cid: Expected(parts.server["params"])}


def pfedcs_wrong(parts: Parts) -> dict[str, Callable[[int], Expected]]:
    return {"the fine-tuned teacher head (the first Fit's) instead of the own trained head":
            lambda cid: replace_head(pfedcs(parts, cid), select(parts.trained(cid, 0), "head")),
            "the downloaded customised classifier v_k":
            lambda cid: replace_head(pfedcs(parts, cid), parts.download(cid)["head"])}


def fedrema_wrong(parts: Parts) -> dict[str, Callable[[int], Expected]]:
    return {"the personalised head sent in the last round (stale)":
            lambda cid: replace_head(fedrema(parts, cid), parts.download(cid)["head"])}


def cwfedavg_wrong(parts: Parts) -> dict[str, Callable[[int], Expected]]:
    return {"the uniform class mix (the initial p~)": lambda cid: uniform_class_mix(parts)}


def fedpcl_wrong(parts: Parts) -> dict[str, Callable[[int], Expected]]:
    def global_prototypes(cid: int) -> Expected:  # no local prototype: predict falls back to the global ones
        expected = fedpcl(parts, cid)
        return with_client(expected, present=torch.zeros_like(expected.client["present"]))
    return {"the global prototypes instead of the client's local ones": global_prototypes}


def rpfedpm_wrong(parts: Parts) -> dict[str, Callable[[int], Expected]]:
    before = parts.before
    return {"psi before its training in the last round":
            lambda cid: with_client(rpfedpm(parts, cid), **psi_of(before[cid])),
            "the initial psi": lambda cid: with_client(rpfedpm(parts, cid), **psi_of(parts.rec.clients[0][cid])),
            "the class features of the previous round": lambda cid: with_client(
                rpfedpm(parts, cid), class_features=before[cid]["class_features"], available=before[cid]["available"])}


# Server optimisers (FedAvgM, FedOpt, SCAFFOLD, FedDyn, FedNova): the server's step recomputed from
# the model the client downloaded in round R (x), the optimiser's state before round R (server-only
# state, read from the state recorded after round R-1) and the models the clients trained in round R.


def state_before_last_round(parts: Parts) -> dict:
    return parts.rec.servers[ROUNDS - 1]


def trained_models(parts: Parts) -> list[Params]:
    return [model_only(parts.trained(j, -1)) for j in range(NUM_CLIENTS)]


def fedavgm(parts: Parts, cid: int) -> Expected:
    """x - eta v, v = beta v_prev + (x - FedAvg mean) (Nesterov: x - eta ((x - mean) + beta v))."""
    h, x, mean = parts.algorithm.hyper, parts.download(cid)["params"], averaged(parts)
    previous = state_before_last_round(parts)["momentum"]
    params = {}
    for name in x:
        pseudo_gradient = x[name] - mean[name]
        momentum = h.beta * previous[name] + pseudo_gradient
        params[name] = x[name] - h.server_lr * (pseudo_gradient + h.beta * momentum if h.nesterov else momentum)
    return Expected(params)


def adaptive_server(second_moment: Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]):
    """Reddi et al.'s Algorithm 2 on Delta = FedAvg mean - x: x + eta m / (sqrt(v) + tau)."""
    def rule(parts: Parts, cid: int) -> Expected:
        h, x, mean = parts.algorithm.hyper, parts.download(cid)["params"], averaged(parts)
        before = state_before_last_round(parts)
        params = {}
        for name in x:
            delta = mean[name] - x[name]
            m = h.beta1 * before["m"][name] + (1 - h.beta1) * delta
            v = second_moment(h, before["v"][name], delta)
            params[name] = x[name] + h.server_lr * m / (v.sqrt() + h.tau)
        return Expected(params)
    rule.__name__ = f"adaptive_server_{second_moment.__name__}"
    rule.__doc__ = f"x + eta m / (sqrt(v) + tau), v by {second_moment.__doc__}"
    return rule


def adam_v(h, v, delta):
    """Adam: beta2 v + (1 - beta2) Delta^2"""
    return h.beta2 * v + (1 - h.beta2) * (delta * delta)


def yogi_v(h, v, delta):
    """Yogi: v - (1 - beta2) Delta^2 sign(v - Delta^2)"""
    return v - (1 - h.beta2) * (delta * delta) * torch.sign(v - delta * delta)


def adagrad_v(h, v, delta):
    """Adagrad: v + Delta^2"""
    return v + delta * delta


def scaffold(parts: Parts, cid: int) -> Expected:
    """x + eta_g (mean of the trained y_j - x); the mean uniform, or by n_j with weights=samples."""
    h, x = parts.algorithm.hyper, parts.download(cid)["params"]
    weights = parts.sizes if h.weights == "samples" else [1.0] * NUM_CLIENTS
    mean = weighted_mean(trained_models(parts), weights)
    return Expected({name: x[name] + h.global_lr * (mean[name] - x[name]) for name in x})


def feddyn(parts: Parts, cid: int) -> Expected:
    """Uniform mean of the trained models - h / alpha, h = h_prev - (alpha / N) sum_j (theta_j - x)."""
    from pfedkit.core.params import WeightedSum

    alpha, x, models = parts.algorithm.hyper.alpha, parts.download(cid)["params"], trained_models(parts)
    drift = WeightedSum()
    for model in models:
        drift.add({name: model[name] - x[name] for name in x}, alpha / NUM_CLIENTS)
    h = {name: value - drift.total[name] for name, value in state_before_last_round(parts)["h"].items()}
    mean = weighted_mean(models, [1.0] * NUM_CLIENTS)
    return Expected({name: mean[name] - h[name] / alpha for name in mean})


def fednova(parts: Parts, cid: int) -> Expected:
    """x - tau_eff sum_j p_j (x - y_j) / s_j, p_j = n_j / n, tau_eff = sum_j p_j s_j, s_j = the step
    probe each client's Fit returned ("step_probe"; 0: the client took no step and adds nothing)."""
    from pfedkit.core.params import WeightedSum, mean_shares

    x, shares = parts.download(cid)["params"], mean_shares(parts.sizes)
    steps = [float(parts.trained(j, -1)["step_probe"]) for j in range(NUM_CLIENTS)]
    tau_eff = sum(p * s for p, s in zip(shares, steps))
    normalised = WeightedSum()
    for model, p, s in zip(trained_models(parts), shares, steps):
        normalised.add({name: x[name] - model[name] for name in x}, p / s if s > 0 else 0.0)  # no step: no update
    return Expected({name: x[name] - tau_eff * normalised.total[name] for name in x})


def server_step_left_out(parts: Parts) -> dict[str, Callable[[int], Expected]]:
    return {"FedAvg's mean of the trained models (the server's own step left out)":
            lambda cid: Expected(averaged(parts))}


@dataclass(frozen=True)
class Rule:
    """How a client's evaluated model is assembled from the parts, and the wrong assemblies to tell
    it from beyond the wrong parts (`wrong_parts`), which every rule is fed."""
    assemble: Callable[[Parts, int], Expected]
    # The model holds a server aggregate (a mean, a cluster model, a re-trained head...): then the
    # client's own trained model is a wrong assembly too.
    holds_aggregate: bool
    wrong: Callable[[Parts], dict[str, Callable[[int], Expected]]] | None = None  # other models of the run

    def __call__(self, parts: Parts, cid: int) -> Expected:
        return self.assemble(parts, cid)

    def described(self) -> str:
        return f"{self.assemble.__name__} ({' '.join((self.assemble.__doc__ or '').split())})"


# The standard assemblies a class names in `evaluated_model` (core.contract.EvaluatedModel).
STANDARD_RULES: dict[str, Rule] = {
    "global": Rule(global_model, holds_aggregate=True),
    "own": Rule(last_trained, holds_aggregate=False, wrong=downloaded_model),
    "shared_body": Rule(shared_and_private("body"), holds_aggregate=True),
    "shared_head": Rule(shared_and_private("head"), holds_aggregate=True),
}
# The methods declaring evaluated_model = "custom", each with its own rule.
CUSTOM_RULES: dict[str, Rule] = {
    "perfedavg": Rule(perfedavg, True), "creff": Rule(creff, True), "ccvr": Rule(ccvr, True, ccvr_wrong), "cfl": Rule(cfl, True),
    "ifca": Rule(ifca, True), "fedpfa": Rule(fedpfa, True), "l2gd": Rule(l2gd, False),
    "ditto": Rule(ditto, False, ditto_wrong), "apfl": Rule(apfl, False), "fedbabu": Rule(fedbabu, True),
    "fedavgft": Rule(fedavgft, True), "fedbn": Rule(fedbn, True, fedbn_wrong),
    "fedrod": Rule(fedrod, True), "fedgh": Rule(fedgh, False), "fedpac": Rule(fedpac, True),
    "fednh": Rule(fednh, False), "fedproto": Rule(fedproto, False), "rpfedpm": Rule(rpfedpm, False, rpfedpm_wrong),
    "pfedcs": Rule(pfedcs, True, pfedcs_wrong), "fedrema": Rule(fedrema, True, fedrema_wrong),
    "cwfedavg": Rule(cwfedavg, True, cwfedavg_wrong),
    "qffl": Rule(qffl, True),
    "fedphp": Rule(fedphp, False, downloaded_model),
    "apple": Rule(apple, False, apple_wrong),
    "fedpcl": Rule(fedpcl, False, fedpcl_wrong), "pfedhn": Rule(pfedhn, True),
    "pfedla": Rule(pfedla, True),
    "knnper": Rule(knnper, True, knnper_wrong),
    "floco": Rule(floco, True, floco_wrong),
    "superfed": Rule(superfed, True),
    "pfedsim": Rule(pfedsim, False, downloaded_model),
    # the mixture reads no single parameter set, so the client's own model is no wrong assembly here
    "fedem": Rule(fedem, False, fedem_wrong),
}
CUSTOM_RULES.update({
    "fedavgm": Rule(fedavgm, True, server_step_left_out),
    "fedadam": Rule(adaptive_server(adam_v), True, server_step_left_out),
    "fedyogi": Rule(adaptive_server(yogi_v), True, server_step_left_out),
    "fedadagrad": Rule(adaptive_server(adagrad_v), True, server_step_left_out),
    "scaffold": Rule(scaffold, True, server_step_left_out),
    "feddyn": Rule(feddyn, True, server_step_left_out),
    "fednova": Rule(fednova, True, server_step_left_out),
})
CUSTOM_RULES.update({"fedala": Rule(fedala, True), "feddbe": Rule(feddbe, True),
                     "fedcac": Rule(fedcac, True), "gpfl": Rule(gpfl, True),
                     "fedcp": Rule(fedcp, True), "pfedfda": Rule(pfedfda, True, pfedfda_wrong)})  # issue 46: Methods II


def rule_for(algorithm: type[Algorithm]) -> Rule:
    """The rule `algorithm` declares (`evaluated_model`); a test failure saying what to do when
    there is none."""
    declared, name = algorithm.evaluated_model, algorithm.name
    if declared is None:
        pytest.fail(f"{name} does not declare how its evaluated model is assembled: set `evaluated_model` on "
                    f"{algorithm.__name__} to one of {', '.join(EVALUATED_MODELS)} (core/contract.py says what "
                    f"each means; compare with its client_model and docs/algorithms/{name}.md)")
    if declared != "custom":
        return STANDARD_RULES[declared]
    if name not in CUSTOM_RULES:
        pytest.fail(f"{name} declares evaluated_model = 'custom' but tests/test_evaluated_model.py has no rule "
                    f"for it: add one to CUSTOM_RULES under {name!r} (read its client_model and "
                    f"docs/algorithms/{name}.md), or declare the standard rule it follows")
    return CUSTOM_RULES[name]


def extra_wrong_parts(rule: Rule, parts: Parts) -> dict[str, Callable[[int], Expected]]:
    """Wrong assemblies that no substitution of parts produces: other models of the same run."""
    own = {"the client's own trained model instead of the aggregate":
           lambda cid: Expected(model_only(parts.trained(cid, -1)))}
    return {**(own if rule.holds_aggregate else {}), **(rule.wrong(parts) if rule.wrong else {})}


def replace_head(expected: Expected, head: Params) -> Expected:
    """`expected` with another head (also in the client state a custom predict reads it from)."""
    client = expected.client
    if isinstance(client, dict) and "head" in client:
        client = {**client, "head": head}
    return replace(expected, params=merge(expected.params, head), client=client)


def with_client(expected: Expected, **entries: Any) -> Expected:
    return replace(expected, client={**expected.client, **entries})


def uniform_class_mix(parts: Parts) -> Expected:
    from pfedkit.algorithms.cwfedavg import personalised_model

    uniform = np.full(len(parts.server["class_wise"]), 1.0 / len(parts.server["class_wise"]))
    return Expected({**parts.server["shared"], **personalised_model(parts.server["class_wise"], uniform)})


# ---------------------------------------------------------------------------------------------
# Evaluating an assembly ourselves


def same_params(a: Params, b: Params) -> bool:
    return set(a) == set(b) and all(torch.equal(a[name], b[name]) for name in a)


def own_loss(rec: Recording, parts: Parts, cid: int, expected: Expected) -> float:
    """Test loss of `expected` on client cid: adapted by our own copy of the adaptation Fit,
    evaluated with the algorithm's predict (fed the expected states) where it has one."""
    runtime, algorithm = rec.runtime, rec.algorithm
    data = runtime.data.clients[cid]
    buffers = rec.evaluated[ROUNDS, cid][1]
    params = expected.params
    if expected.adapt is not None:
        job = FitJob(ROUNDS, cid, 0, replace(expected.adapt, params=params), buffers, None, purpose="adapt")
        outcome = runtime.trainers(cid).fit(job, data.x_train, data.y_train)
        params, buffers = outcome.params, outcome.buffers
    predict = None
    server = parts.server if expected.server is None else expected.server
    client = expected.client
    if client is None:  # what the client predicts with, built from the stored state as the engine does
        evaluated = replace(data, buffers_source=lambda: buffers)
        client = algorithm.evaluation_state(cid, server, parts.clients[cid], params, evaluated)
    if expected.predict_inputs is not None:
        predict = OnInputs(partial(expected.predict_inputs, server, client, buffers))
    elif algorithm.has_input_predict():
        predict = OnInputs(partial(algorithm.predict_inputs, cid, server, client, buffers=buffers))
    elif algorithm.has_custom_predict():
        predict = partial(algorithm.predict, cid, server, client)
    return runtime.evaluators(cid).evaluate(params, buffers, data.x_test, data.y_test, predict).loss


def recorded_losses(result) -> dict[int, float]:
    rows = result.metrics[result.metrics["round"] == ROUNDS]
    return {int(row.client): float(row.loss) for row in rows.itertuples()}


def same_state(a: Any, b: Any) -> bool:
    """Equal nested states (dicts, lists, tensors, arrays, numbers)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b))
    return a is b or a == b


def differing(expected: Params, evaluated: Params) -> list[str]:
    return sorted(set(expected) ^ set(evaluated)) + sorted(
        n for n in set(expected) & set(evaluated) if not torch.equal(expected[n], evaluated[n]))


def assert_evaluates_assembly(algorithm: str, rec: Recording, result) -> None:
    """Checks 1-3 of the module docstring for every client of the last round."""
    parts = true_parts(rec, [int(c.n_train) for c in rec.runtime.data.clients])
    rule, losses = rule_for(get_algorithm(algorithm)), recorded_losses(result)
    powerless, distinct = [], set()
    for cid in range(NUM_CLIENTS):
        expected = rule(parts, cid)
        evaluated = rec.adapted[ROUNDS, cid][0].params if expected.adapt is not None else rec.evaluated[ROUNDS, cid][0]
        assert same_params(evaluated, expected.params), (
            f"{algorithm}: client {cid} was evaluated with other parameters than {rule.described()} "
            f"assembles; differing: {differing(expected.params, evaluated)}")
        loss = own_loss(rec, parts, cid, expected)
        assert math.isclose(losses[cid], loss, rel_tol=1e-6, abs_tol=1e-9), (
            f"{algorithm}: client {cid}'s recorded loss {losses[cid]} is not the loss {loss} of the model "
            f"{rule.assemble.__name__} assembles")
        wrong = {label: (lambda c, p=p: rule(p, c)) for label, p in wrong_parts(parts).items()}
        wrong.update(extra_wrong_parts(rule, parts))
        for label, assemble in wrong.items():
            try:
                alternative = assemble(cid)
            except (KeyError, IndexError):
                continue  # these parts lack what the rule reads (a download without a head...)
            if same_params(alternative.params, expected.params) and same_state(alternative.client, expected.client) \
                    and same_state(alternative.server, expected.server):
                continue  # the same model (e.g. FedBABU's fixed head is the initial one)
            distinct.add(label)
            if math.isclose(own_loss(rec, parts, cid, alternative), losses[cid], rel_tol=1e-6, abs_tol=1e-9):
                powerless.append(f"client {cid}: {label}")
    assert "the initial model" in distinct, f"{algorithm}: after {ROUNDS} rounds a client still evaluates the initial model"
    assert not powerless, f"{algorithm}: wrong assemblies that the recorded loss cannot tell apart: {powerless}"


@pytest.mark.parametrize(("algorithm", "changes"), CASES)
def test_every_algorithm_evaluates_the_downloaded_and_trained_parts(algorithm, changes, tmp_path, monkeypatch):
    rule_for(get_algorithm(algorithm))  # fails first, saying what to declare or add, when there is no rule
    rec, result = recorded_run(algorithm, tmp_path, monkeypatch, changes)
    assert_evaluates_assembly(algorithm, rec, result)


def test_custom_rules_belong_to_methods_declaring_custom():
    """A method that moved to a standard rule (or went) leaves no custom rule behind that nothing runs."""
    stale = {name: get_algorithm(name).evaluated_model if name in algorithm_names() else "not registered"
             for name in CUSTOM_RULES
             if name not in algorithm_names() or get_algorithm(name).evaluated_model != "custom"}
    assert stale == {}


def test_a_method_without_a_rule_fails_saying_what_to_declare_or_add():
    from pfedkit.algorithms.fedavg import FedAvg

    undeclared = type("Undeclared", (FedAvg,), {"name": "undeclared", "evaluated_model": None})
    with pytest.raises(pytest.fail.Exception, match="does not declare .* set `evaluated_model` on Undeclared"):
        rule_for(undeclared)
    custom = type("Mixed", (FedAvg,), {"name": "mixed", "evaluated_model": "custom"})
    with pytest.raises(pytest.fail.Exception, match="no rule for it: add one to CUSTOM_RULES under 'mixed'"):
        rule_for(custom)
    assert rule_for(type("Plain", (FedAvg,), {"name": "plain"})) is STANDARD_RULES["global"]  # inherited
