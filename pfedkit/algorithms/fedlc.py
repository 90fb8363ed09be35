"""FedLC (Zhang, Li, Li, Xu, Wu, Ding, Wu, ICML 2022): FedAvg whose local loss calibrates the
logits by the client's class counts, so rare classes need a larger logit to be predicted.

Client i subtracts a per-class margin from each logit before the softmax cross-entropy:

    z'_c = z_c - tau * n_{i,c}^{-1/4}                              (the calibrated logits)
    L_cal = -log( e^{z'_y} / sum_{c} e^{z'_c} )                    (denominator "all", default)
    L_cal = -log( e^{z'_y} / sum_{c != y} e^{z'_c} )               (denominator "not_true": as printed)

A class the client does not hold (n_{i,c} = 0) gets an infinite margin: it leaves the softmax, the
limit of the margin as n -> 0 (FL-bench's stand-in count 1e-8 gives a margin of 100 tau: the same
for logits of ordinary size). The softmax ignores a constant added to every logit, so the margins
are taken relative to the smallest one (the client's most frequent class): the same loss, and a
client with equal class counts subtracts exactly 0, i.e. plain cross-entropy. tau = 0 is FedAvg.
`counts=global` takes n_c summed over every client instead (PFLlib's reading: one margin vector for
the federation, read from `Setup.train_counts`, a setup-time fact not counted as traffic).

Server: FedAvg (n_i weights). Client state: none. Evaluated model: the global model (no
calibration at evaluation). Communication: the model down, the model + n_i up.
"""
from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from pfedkit.algorithms.fedavg import FedAvg
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import ClientData, ClientUpdate, Fit, Forward, HyperParams, Message
from pfedkit.core.errors import ConfigError
from pfedkit.core.search import float_range


def class_margins(class_counts: np.ndarray, tau: float) -> torch.Tensor:
    """[C] margins tau * n_c^{-1/4} minus the smallest of them (that of the most frequent class);
    +inf for a class with n_c = 0. tau = 0 calibrates nothing: zeros."""
    counts = torch.as_tensor(np.asarray(class_counts, dtype=np.float64))
    held = counts > 0
    if tau == 0 or not held.any():
        return torch.zeros(len(counts), dtype=torch.float32)
    margins = tau * counts.pow(-0.25)  # n = 0: +inf, the class leaves the softmax
    # a constant subtracted from every logit leaves the softmax as it is
    return (margins - margins[held].min()).float()


def calibrated_loss(out: Forward, y: torch.Tensor, params: Any, context: Mapping[str, Any], *,
                    denominator: str) -> torch.Tensor:
    """Mean L_cal over the batch, logits z - context["margins"] (FedLC eq. of the calibrated loss)."""
    logits = out.logits - context["margins"]
    if denominator == "all":
        return F.cross_entropy(logits, y)
    true_logit = logits.gather(1, y[:, None]).squeeze(1)
    not_true = logits.scatter(1, y[:, None], -torch.inf)
    return (torch.logsumexp(not_true, dim=1) - true_logit).mean()


@register
class FedLC(FedAvg):
    name = "fedlc"
    description = "FedLC: FedAvg with logits calibrated by per-class margins tau * n_c^(-1/4)"

    class Hyper(HyperParams):
        """FedLC options.

        tau: margin scale, 1.0 [code: FL-bench and PFLlib; the paper's value not retrieved].
        denominator: "all" (a softmax over every class, FL-bench's reading) or "not_true" (the
            paper's equation as printed, the true class left out of the denominator: unbounded
            below, FL-bench reports that training collapses with it).
        counts: "client" (n_{i,c}, the client's own counts: the paper, FL-bench) or "global"
            (sum_i n_{i,c} over the federation, read from the setup: PFLlib's reading).
        """
        tau: float = Field(1.0, ge=0, description="scale of the per-class margins tau * n_c^(-1/4)",
                           json_schema_extra=float_range(0.01, 10.0, log=True))
        denominator: Literal["all", "not_true"] = Field(
            "all", description="softmax denominator: every class (FL-bench), or the not-true classes "
            "(the paper's equation as printed; unbounded below)")
        counts: Literal["client", "global"] = Field(
            "client", description="class counts of the margins: the client's own (paper) or the "
            "federation's (PFLlib)")

    def check(self) -> None:
        if self.hyper.denominator == "not_true" and self.hyper.tau > 0 and self.hyper.counts == "client":
            held = (np.asarray(self.setup.train_counts) > 0).sum(axis=1)
            if (held < 2).any():
                raise ConfigError(f"fedlc.denominator=not_true: client {int(np.argmin(held))} holds one class, so its "
                                  "denominator (the other held classes) is empty; use fedlc.denominator=all")

    def client_update(self, rnd: int, cid: int, client: Any, message: Message, data: ClientData) -> ClientUpdate:
        loss = partial(calibrated_loss, denominator=self.hyper.denominator)
        counts = data.class_counts if self.hyper.counts == "client" else self.setup.train_counts.sum(axis=0)
        params = yield Fit(message["params"], loss=loss, context={"margins": class_margins(counts, self.hyper.tau)})
        return client, {"params": params, "weight": data.n_train}
