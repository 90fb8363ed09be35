"""FedNTD (Lee, Jeong, Shin, Bae, Yun, NeurIPS 2022): FedAvg whose local loss distils the received
global model's knowledge of the not-true classes, to keep what the client's data cannot refresh.

For a sample of class y with local logits z and the received global model's logits z^g, the
not-true distributions drop the true class before a softmax at temperature tau:

    q~_c   = exp(z_c / tau)   / sum_{c' != y} exp(z_c' / tau)     (c != y; the local model)
    q~^g_c = exp(z^g_c / tau) / sum_{c' != y} exp(z^g_c' / tau)   (c != y; the global model, frozen)
    L_NTD = tau^2 * sum_{c != y} q~^g_c log(q~^g_c / q~_c)          (KL(q~^g || q~), mean over the batch)
    L = CE(z, y) + beta * L_NTD

The factor tau^2 is the official code's (`NTD_Loss`, a distillation convention); with the default
tau = 1 it is 1. beta = 0 is FedAvg.

Per round and participant, z^g of every training sample is computed once from the received
model (eval mode, the client's own BatchNorm statistics, no gradient) and sent with the Fit as
context["global_logits"]; the loss reads the batch's rows at `Forward.index` [ours: the official
code runs the frozen copy on each batch, the same numbers for models without BatchNorm or dropout].

Server: FedAvg (n_i weights). Client state: none. Evaluated model: the global model.
Communication: the model down, the model + n_i up.
"""
from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field

from pfedkit.algorithms.fedavg import FedAvg
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import ClientData, ClientUpdate, cross_entropy, Fit, Forward, HyperParams, Message
from pfedkit.core.search import float_range

CHUNK = 1000  # samples per eval-mode forward when computing the global model's logits (bounded memory)


def not_true_logits(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[B, C - 1] the logits of every class but the true one, in class order: column k holds class
    k for k < y and class k + 1 from y on (a gather, so it runs under vmap)."""
    columns = torch.arange(logits.shape[1] - 1, device=logits.device)
    positions = columns[None, :] + (columns[None, :] >= y[:, None]).long()
    return logits.gather(1, positions)


def not_true_distillation(logits: torch.Tensor, global_logits: torch.Tensor, y: torch.Tensor,
                          tau: float) -> torch.Tensor:
    """L_NTD = tau^2 KL(q~^g || q~) over the not-true classes, mean over the batch."""
    local = F.log_softmax(not_true_logits(logits, y) / tau, dim=1)
    teacher = F.log_softmax(not_true_logits(global_logits, y) / tau, dim=1)
    return tau ** 2 * (teacher.exp() * (teacher - local)).sum(dim=1).mean()


def ntd_loss(out: Forward, y: torch.Tensor, params: Any, context: Mapping[str, Any], *,
             beta: float, tau: float) -> torch.Tensor:
    """CE(z, y) + beta * L_NTD(z, z^g), z^g = context["global_logits"] read at the batch's rows."""
    global_logits = context["global_logits"][out.index]
    return cross_entropy(out, y, params, context) + beta * not_true_distillation(out.logits, global_logits, y, tau)


@register
class FedNTD(FedAvg):
    name = "fedntd"
    description = "FedNTD: FedAvg + beta * KL distillation of the global model on the not-true classes"

    class Hyper(HyperParams):
        """FedNTD options: beta = 1, tau = 1 (the official code's config/fedntd.json; its class
        default tau = 3)."""
        beta: float = Field(1.0, ge=0, description="weight of the not-true distillation term",
                            json_schema_extra=float_range(0.1, 10.0, log=True))
        tau: float = Field(1.0, gt=0, description="softmax temperature of the not-true distributions",
                           json_schema_extra=float_range(0.5, 5.0, log=True))

    def client_update(self, rnd: int, cid: int, client: Any, message: Message, data: ClientData) -> ClientUpdate:
        received = message["params"]
        global_logits = self.setup.ops_for(cid).logits(received, data.x_train, data.buffers, chunk=CHUNK).float()
        loss = partial(ntd_loss, beta=self.hyper.beta, tau=self.hyper.tau)
        params = yield Fit(received, loss=loss, context={"global_logits": global_logits})
        return client, {"params": params, "weight": data.n_train}
