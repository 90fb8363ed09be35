"""Server optimisers on FedAvg's pseudo-gradient: FedAvgM and Reddi et al.'s FedOpt family.

FedAvgM (Hsu, Qi, Brown, arXiv:1909.06335, 2019) and FedAdam, FedYogi, FedAdagrad (Reddi, Charles,
Zaheer, Garrett, Rush, Konecny, Kumar, McMahan, "Adaptive Federated Optimization", ICLR 2021).
The clients are FedAvg's, unchanged (the model down; E epochs of the run's SGD; the model + n_i
up). The server does not keep the mean of the uploads: it treats the difference between that
mean and its model as a gradient for an optimiser of its own, whose moments live in the server
state:

    Delta_t = sum_i p_i (y_i - x_t),  p_i = n_i / sum_j n_j over the round's participants

    FedAvgM (Hsu et al., sec. 3):   v <- beta v + (x_t - mean_i y_i);  x_{t+1} = x_t - eta v
                                    (Nesterov, FL-bench's: x_{t+1} = x_t - eta ((x_t - mean) + beta v))
    FedOpt (Reddi et al., Alg. 2):  m_t = beta1 m_{t-1} + (1 - beta1) Delta_t
        FedAdagrad:  v_t = v_{t-1} + Delta_t^2
        FedYogi:     v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2)
        FedAdam:     v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2
                     x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)     (no bias correction, as Alg. 2)

with m_{-1} = 0 and v_{-1} = tau^2 (Alg. 2 asks v_{-1} >= tau^2; `initial_v` sets another value,
0 as FL-bench and Flower). Because the server state is not the n_i-weighted mean, these methods
are not `MeanOfUploads`, and client-level DP refuses them. The mean itself is still folded reply
by reply (`SampleWeightedMean`): one model in memory, not one per participant.

Evaluated model: the server's model x_{t+1}. Communication: FedAvg's (the model down, the model +
n_i up); the moments never leave the server. Equations, defaults and the differences with
FL-bench: docs/algorithms/fedopt.md.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from pydantic import Field

from pfedkit.algorithms.fedavg import FedAvg
from pfedkit.algorithms.registry import register
from pfedkit.core.aggregation import Aggregation, Message, SampleWeightedMean, fedavg_aggregate
from pfedkit.core.contract import Algorithm, HyperParams
from pfedkit.core.params import Params, clone
from pfedkit.core.search import float_range
from pfedkit.core.sgd import sgd_momentum_step


class PseudoGradientServer(Algorithm):
    """FedAvg's clients, and a server that turns the n_i-weighted mean of their uploads into one
    step of an optimiser (`server_step`) whose state sits beside the model in the server state."""
    evaluated_model = "custom"  # the server optimiser's model: not the mean of the uploads

    # FedAvg's client half, taken as it is. (FedAvg itself cannot be subclassed here: it is a
    # `MeanOfUploads`, which refuses a subclass that aggregates otherwise.)
    broadcast = FedAvg.broadcast
    local_fit = FedAvg.local_fit
    client_update = FedAvg.client_update
    client_model = FedAvg.client_model

    def init_server(self, params: Params) -> dict[str, Any]:
        return {"params": clone(params), **self.initial_optimiser_state(params)}

    def initial_optimiser_state(self, params: Params) -> dict[str, Params]:
        """The optimiser's tensors before round 1 (moments), by server-state key."""
        raise NotImplementedError

    def server_step(self, server: dict, mean: Params) -> dict[str, Any]:
        """The new server state from the n_i-weighted mean of the round's uploaded models."""
        raise NotImplementedError

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        return self.server_step(server, fedavg_aggregate(replies)) if replies else server

    def start_aggregation(self, rnd: int, server: dict, cids: list[int]) -> Aggregation:
        """The mean folded reply by reply (bit for bit `fedavg_aggregate`), then `server_step`."""
        counts = self.setup.train_counts
        return SampleWeightedMean("params", {cid: float(counts[cid].sum()) for cid in cids},
                                  partial(self.server_step, server), server)


def zeros_like(params: Params) -> Params:
    return {name: torch.zeros_like(value) for name, value in params.items()}


# --- FedAvgM ---------------------------------------------------------------------------------


@register
class FedAvgM(PseudoGradientServer):
    name = "fedavgm"
    description = "FedAvgM: FedAvg's clients, server SGD with momentum on the pseudo-gradient"

    class Hyper(HyperParams):
        """FedAvgM options. beta 0.9 [FL-bench; one of Hsu et al.'s values {0.7, 0.9, 0.97, 0.99,
        0.997}]; server_lr 1 [Hsu et al.: x <- x - v, no server learning rate]; nesterov off [Hsu
        et al.; FL-bench uses torch's Nesterov SGD]."""
        beta: float = Field(0.9, ge=0, lt=1, description="server momentum beta",
                            json_schema_extra=float_range(0.0, 0.99))
        server_lr: float = Field(1.0, gt=0, description="server learning rate eta (1: Hsu et al.'s x <- x - v)",
                                 json_schema_extra=float_range(0.1, 2.0, log=True))
        nesterov: bool = Field(False, description="Nesterov momentum on the server (FL-bench's FedAvgM)")

    def initial_optimiser_state(self, params: Params) -> dict[str, Params]:
        return {"momentum": zeros_like(params)}

    def server_step(self, server: dict, mean: Params) -> dict[str, Any]:
        h = self.hyper
        x = server["params"]
        pseudo_gradient = {name: value - mean[name] for name, value in x.items()}  # g = x_t - mean_i y_i
        params, momentum = sgd_momentum_step(x, pseudo_gradient, server["momentum"], lr=h.server_lr,
                                             momentum=h.beta, nesterov=h.nesterov)
        return {"params": params, "momentum": momentum}


# --- FedAdagrad, FedYogi, FedAdam ----------------------------------------------------------


def adagrad_second_moment(v: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """FedAdagrad (Alg. 2): v_t = v_{t-1} + Delta_t^2."""
    return v + delta * delta


def yogi_second_moment(v: torch.Tensor, delta: torch.Tensor, *, beta2: float) -> torch.Tensor:
    """FedYogi (Alg. 2): v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2): v moves
    towards Delta^2 by a fixed fraction of Delta^2, not of the gap (Adam's), so it grows slowly."""
    squared = delta * delta
    return v - (1 - beta2) * squared * torch.sign(v - squared)


def adam_second_moment(v: torch.Tensor, delta: torch.Tensor, *, beta2: float) -> torch.Tensor:
    """FedAdam (Alg. 2): v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2."""
    return beta2 * v + (1 - beta2) * (delta * delta)


SecondMoment = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (v_{t-1}, Delta_t) -> v_t


def adaptive_step(x: Params, m: Params, v: Params, mean: Params, *, second_moment: SecondMoment, lr: float,
                  beta1: float, tau: float) -> tuple[Params, Params, Params]:
    """(x_{t+1}, m_t, v_t) of Reddi et al.'s Algorithm 2 for Delta_t = mean - x_t:
    m_t = beta1 m_{t-1} + (1 - beta1) Delta_t; v_t = second_moment(v_{t-1}, Delta_t);
    x_{t+1} = x_t + lr m_t / (sqrt(v_t) + tau)."""
    new_x, new_m, new_v = {}, {}, {}
    for name, value in x.items():
        delta = mean[name] - value
        new_m[name] = beta1 * m[name] + (1 - beta1) * delta
        new_v[name] = second_moment(v[name], delta)
        new_x[name] = value + lr * new_m[name] / (new_v[name].sqrt() + tau)
    return new_x, new_m, new_v


class AdaptiveHyper(HyperParams):
    """Options of Reddi et al.'s Algorithm 2 (FedAdagrad's; FedAdam and FedYogi add beta2).
    Defaults: the paper's best CIFAR-10 values for FedAdam (docs/algorithms/fedopt.md)."""
    server_lr: float = Field(0.01, gt=0, description="server learning rate eta",
                             json_schema_extra=float_range(0.001, 1.0, log=True))
    beta1: float = Field(0.9, ge=0, lt=1, description="first-moment decay beta1 (0: no server momentum)")
    tau: float = Field(0.001, gt=0, description="adaptivity tau (added to sqrt(v))",
                       json_schema_extra=float_range(0.00001, 0.1, log=True))
    initial_v: float | None = Field(None, ge=0, description="v_{-1} (None: tau^2, the bound of Alg. 2; "
                                    "0: FL-bench and Flower)")


class SecondMomentHyper(AdaptiveHyper):
    """FedAdam's and FedYogi's options."""
    beta2: float = Field(0.99, ge=0, lt=1, description="second-moment decay beta2")


class AdaptiveServer(PseudoGradientServer):
    """Reddi et al.'s FedOpt server; a subclass names its second-moment rule."""
    Hyper = AdaptiveHyper

    def second_moment(self) -> SecondMoment:
        raise NotImplementedError

    def initial_optimiser_state(self, params: Params) -> dict[str, Params]:
        h = self.hyper
        start = h.tau ** 2 if h.initial_v is None else h.initial_v
        return {"m": zeros_like(params), "v": {name: torch.full_like(value, start) for name, value in params.items()}}

    def server_step(self, server: dict, mean: Params) -> dict[str, Any]:
        h = self.hyper
        params, m, v = adaptive_step(server["params"], server["m"], server["v"], mean,
                                     second_moment=self.second_moment(), lr=h.server_lr, beta1=h.beta1, tau=h.tau)
        return {"params": params, "m": m, "v": v}


@register
class FedAdam(AdaptiveServer):
    name = "fedadam"
    description = "FedAdam: FedAvg's clients, server Adam on the pseudo-gradient (Reddi et al.)"
    Hyper = SecondMomentHyper

    def second_moment(self) -> SecondMoment:
        return partial(adam_second_moment, beta2=self.hyper.beta2)


@register
class FedYogi(AdaptiveServer):
    name = "fedyogi"
    description = "FedYogi: FedAvg's clients, server Yogi on the pseudo-gradient (Reddi et al.)"
    Hyper = SecondMomentHyper  # FedAdam's defaults [ours]

    def second_moment(self) -> SecondMoment:
        return partial(yogi_second_moment, beta2=self.hyper.beta2)


@register
class FedAdagrad(AdaptiveServer):
    name = "fedadagrad"
    description = "FedAdagrad: FedAvg's clients, server Adagrad on the pseudo-gradient (Reddi et al.)"

    class Hyper(AdaptiveHyper):
        """The paper's best CIFAR-10 values (eta 10^-1, tau 10^-2); no server momentum (beta1 0, as
        TensorFlow's Adagrad, which the paper's experiments ran, and Flower's FedAdagrad)."""
        server_lr: float = Field(0.1, gt=0, description="server learning rate eta",
                                 json_schema_extra=float_range(0.001, 1.0, log=True))
        beta1: float = Field(0.0, ge=0, lt=1, description="first-moment decay beta1 (0: no server momentum)")
        tau: float = Field(0.01, gt=0, description="adaptivity tau (added to sqrt(v))",
                           json_schema_extra=float_range(0.00001, 0.1, log=True))

    def second_moment(self) -> SecondMoment:
        return adagrad_second_moment
