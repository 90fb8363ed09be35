"""FedALA (Zhang, Hua, Wang, Song, Xue, Ma, Guan, *FedALA: Adaptive Local Aggregation for
Personalized Federated Learning*, AAAI 2023).

Before its local training, client i does not overwrite its local model theta_i with the received
global model theta (FedAvg) but aggregates the two element-wise (Adaptive Local Aggregation, ALA):

    theta_hat_i = theta_i + (theta - theta_i) ⊙ W_i      on the top p layers,           (ALA, Eq. 3)
    theta_hat_i = theta                                    on the layers below them,
    W_i <- clip_[0,1](W_i - eta * grad_{theta_hat_i} L(theta_hat_i; D_i^s) ⊙ (theta - theta_i))  (Eq. 5)

W_i has the top layers' shapes, starts at 1 (all global) and is kept by the client across
rounds; D_i^s is a random fraction s of the client's training data, drawn each round. W_i is
trained per mini-batch of D_i^s (cross-entropy at theta_hat_i), theta_hat_i recomputed after each
update: in the client's first ALA until the standard deviation of its last `num_pre_loss`
recorded losses (one per epoch, the epoch's last batch, as the authors' code) is below
`threshold` (at most `max_warmup_epochs` epochs), in every later round for one epoch. Then theta_hat_i
is trained E epochs as in FedAvg, kept as the new theta_i and uploaded; the server averages the
uploads (FedAvg, n_i weights). A client that never trained has no theta_i: it starts from theta
(the authors' code skips ALA while theta_i = theta, i.e. in round 1).

theta_i + (theta - theta_i) ⊙ W is computed as `torch.lerp(theta_i, theta, W)`, exact at the two
ends: W = 1 gives theta bit for bit (FedAvg's start: nothing local is kept), W = 0 theta_i's top layers.

The ALA epochs are `Fit` requests with a custom step (`ala_step`) on `Fit.samples`; W, the top
layers of theta_i and theta travel as `Fit.extra` (so the vectorized runtime runs them with its
sequential fallback; the local training itself is a plain request). Evaluated model: the ALA
start the client would compute from the current global model with its current W_i (no W
training at evaluation). Communication: the model down, the model + n_i up (W_i never travels).
Paper-vs-code table: docs/algorithms/fedala.md.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from pydantic import Field

from pfedkit.algorithms.registry import register
from pfedkit.core.aggregation import MeanOfUploads
from pfedkit.core.contract import Algorithm, Batch, ClientData, ClientUpdate, Fit, HyperParams, Message, StepTools
from pfedkit.core.errors import ConfigError
from pfedkit.core.params import Params, clone, merge
from pfedkit.core.search import float_range, int_range
from pfedkit.core.seeds import torch_generator

WEIGHT = "ala_weight."  # prefixes of W_i, theta_i's and theta's top layers among a Fit's extra tensors
LOCAL = "ala_local."
GLOBAL = "ala_global."
LAST_LOSS = "ala_last_loss"  # the loss of the step's batch, written by `ala_step` (read after each epoch)


# ---------------------------------------------------------------------------------------------
# The math (pure functions)


def layer_of(name: str) -> str:
    """The layer a parameter belongs to: its name without the last component
    ("body.conv1.weight" -> "body.conv1")."""
    return name.rsplit(".", 1)[0]


def top_layer_names(params: Params, layers: int) -> list[str]:
    """The parameters of the last `layers` layers, in the model's order (the authors' code counts
    parameter tensors instead: its layer_idx = 2 is the last layer's weight and bias)."""
    order = list(dict.fromkeys(layer_of(name) for name in params))
    chosen = set(order[-layers:])
    return [name for name in params if layer_of(name) in chosen]


def ala_mix(local: Params, global_: Params, weights: Params) -> Params:
    """theta_hat = theta_i + (theta - theta_i) ⊙ W on the names of `weights`, the global model
    elsewhere (Eq. 3). torch.lerp is exact at W = 0 (theta_i) and W = 1 (theta)."""
    mixed = {name: torch.lerp(local[name], global_[name], weight) for name, weight in weights.items()}
    return merge(global_, mixed)


def ala_step(tools: StepTools, batches: list[Batch]) -> float:
    """One weight-learning step (Eq. 5) on one batch of D_i^s, eta = tools.lr: the gradient of the
    request's loss at the live theta_hat (top layers only), W <- clip(W - eta g ⊙ (theta - theta_i)),
    then theta_hat's top layers <- theta_i + (theta - theta_i) ⊙ W. Lower layers stay as given."""
    (batch,) = batches
    params = tools.params
    names = [name[len(WEIGHT):] for name in params if name.startswith(WEIGHT)]
    loss, grads = tools.loss_and_grad(batch, wrt=names)
    with torch.no_grad():
        for name in names:
            weight, local, global_ = params[WEIGHT + name], params[LOCAL + name], params[GLOBAL + name]
            weight.copy_((weight - tools.lr * grads[name] * (global_ - local)).clamp(0.0, 1.0))
            params[name].copy_(torch.lerp(local, global_, weight))
        params[LAST_LOSS].fill_(float(loss))
    return float(loss)


def converged(losses: list[float], window: int, threshold: float) -> bool:
    """The authors' stopping rule of the first ALA: more than `window` losses recorded and the
    (population) standard deviation of the last `window` below `threshold`."""
    return len(losses) > window and float(np.std(losses[-window:])) < threshold


def sample_subset(n: int, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """int(fraction * n) distinct positions (at least one) of a training set of n samples."""
    size = max(1, int(fraction * n))
    return torch.randperm(n, generator=generator)[:size]


# ---------------------------------------------------------------------------------------------
# The algorithm


@register
class FedALA(MeanOfUploads, Algorithm):
    """The server averages the uploaded models (`MeanOfUploads`, key "params")."""
    name = "fedala"
    description = "FedALA: each client mixes global and local top layers element-wise with learned weights W in [0,1]"
    evaluated_model = "custom"  # global lower layers + lerp(own model, global, W_i) on the top layers
    quick_test_options = {"num_pre_loss": 2, "max_warmup_epochs": 4}  # (the first ALA runs 11+ epochs by default)

    class Hyper(HyperParams):
        layers: int = Field(1, ge=1, description="p: top layers aggregated element-wise (lower layers take the "
                            "global model); 1 = the last layer (the authors' layer_idx=2 tensors)",
                            json_schema_extra=int_range(1, 3))
        sample_fraction: float = Field(0.8, gt=0, le=1, description="s: fraction of the training data W is "
                                       "learned on, drawn each round", json_schema_extra=float_range(0.1, 1.0))
        eta: float = Field(1.0, ge=0, description="learning rate of W (0: W stays at 1, the FedAvg start)",
                           json_schema_extra=float_range(0.1, 10.0, log=True))
        threshold: float = Field(0.1, gt=0, description="the first ALA trains W until the std of the last "
                                 "num_pre_loss epoch losses is below this")
        num_pre_loss: int = Field(10, ge=1, description="how many recorded losses the first ALA's stopping rule reads")
        max_warmup_epochs: int = Field(100, ge=1, description="at most this many epochs in the first ALA "
                                       "(the authors' loop has no bound)")

    def check(self) -> None:
        count = len(dict.fromkeys(layer_of(name) for name in self.setup.ops.initial_params()))
        if self.hyper.layers > count:
            raise ConfigError(f"fedala.layers={self.hyper.layers} but the model has {count} layers with "
                              f"parameters; set fedala.layers between 1 and {count}")

    def init_server(self, params: Params) -> dict[str, Any]:
        return {"params": clone(params)}

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        """Nothing yet: no local model (it starts from the global one) and W = 1 at its first ALA."""
        return {"local": {}, "weights": {}}

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        return {cid: {"params": server["params"]} for cid in cids}

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        received, weights = message["params"], client["weights"]
        start = received
        if client["local"]:
            start, weights = yield from self.adaptive_local_aggregation(rnd, cid, client, received, data)
        trained = yield Fit(start)
        return {"local": trained, "weights": weights}, {"params": trained, "weight": data.n_train}

    def adaptive_local_aggregation(self, rnd: int, cid: int, client: dict, received: Params,
                                   data: ClientData) -> ClientUpdate:
        """The ALA epochs on this round's D_i^s; returns (theta_hat_i, the new W_i)."""
        hyper = self.hyper
        top = top_layer_names(received, hyper.layers)
        weights = client["weights"] or {name: torch.ones_like(received[name]) for name in top}
        subset = sample_subset(data.n_train, hyper.sample_fraction,
                               torch_generator(self.setup.seed, rnd, cid, "fedala-subset"))
        carried = {**{LOCAL + n: client["local"][n] for n in top}, **{GLOBAL + n: received[n] for n in top},
                   LAST_LOSS: torch.zeros(())}
        start = ala_mix(client["local"], received, weights)
        first_ala = not client["weights"]  # W is created at the first ALA and kept afterwards
        losses: list[float] = []
        while True:
            answer = yield Fit(start, step=ala_step, lr=hyper.eta, epochs=1, samples=subset, drop_last=False,
                               extra={**carried, **{WEIGHT + n: w for n, w in weights.items()}})
            start = {name: answer[name] for name in received}
            weights = {name: answer[WEIGHT + name] for name in top}
            losses.append(float(answer[LAST_LOSS]))
            if not first_ala or len(losses) >= hyper.max_warmup_epochs or \
                    converged(losses, hyper.num_pre_loss, hyper.threshold):
                return start, weights

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        """The ALA start from the current global model with the client's current W_i (the global
        model for a client that never trained)."""
        if not client["local"]:
            return server["params"]
        weights = client["weights"] or {name: torch.ones_like(server["params"][name])
                                        for name in top_layer_names(server["params"], self.hyper.layers)}
        return ala_mix(client["local"], server["params"], weights)
