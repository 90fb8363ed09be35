"""FedRS (Li, Zhan, KDD 2021): FedAvg whose local loss uses a restricted softmax, scaling down
the logits of the classes the client does not hold so that local training pushes them (and their
classifier weights) down less.

Client i trains on the cross-entropy of the scaled logits

    o_c = s_{i,c} z_c,   s_{i,c} = 1 if n_{i,c} > 0 else alpha              (scaling "presence")
                         s_{i,c} = alpha + (1 - alpha) n_{i,c} / max_c n_{i,c}  (scaling "proportional")

with alpha in [0, 1]. "presence" is the paper's restricted softmax (observed classes untouched,
missing ones scaled by alpha); "proportional" is the official code's (FedRepo `fedrs.py`): missing
classes get alpha, the most frequent class 1, the others in between. z_c is the model's whole
logit (bias included) [ours: the official code scales w_c^T h and leaves the bias out of training].
alpha = 1 is FedAvg, and a client holding every class is unaffected under "presence".

Server: FedAvg (n_i weights). Client state: none. Evaluated model: the global model (plain softmax
at evaluation). Communication: the model down, the model + n_i up.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from pfedkit.algorithms.fedavg import FedAvg
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import ClientData, ClientUpdate, Fit, Forward, HyperParams, Message
from pfedkit.core.search import float_range


def class_scales(class_counts: np.ndarray, alpha: float, scaling: str) -> torch.Tensor:
    """[C] factors s_c: 1 for held classes and alpha for missing ones ("presence"), or
    alpha + (1 - alpha) n_c / max n ("proportional")."""
    counts = torch.as_tensor(np.asarray(class_counts, dtype=np.float64))
    if scaling == "presence":
        return torch.where(counts > 0, 1.0, alpha).float()
    share = counts / counts.max() if counts.max() > 0 else counts
    return (alpha + (1.0 - alpha) * share).float()


def restricted_softmax_loss(out: Forward, y: torch.Tensor, params: Any, context: Mapping[str, Any]) -> torch.Tensor:
    """Mean cross-entropy of the scaled logits s_c z_c, s = context["scales"] (the restricted softmax)."""
    return F.cross_entropy(out.logits * context["scales"], y)


@register
class FedRS(FedAvg):
    name = "fedrs"
    description = "FedRS: FedAvg with a restricted softmax (logits of missing classes scaled by alpha)"

    class Hyper(HyperParams):
        """FedRS options.

        alpha: scale of the missing classes' logits, 0.5 [ours: the middle of the official code's
            grid {0.1, 0.5, 0.9}; the paper's default not retrieved]; 1 is FedAvg.
        scaling: "presence" (the paper's restricted softmax) or "proportional" (the official code).
        """
        alpha: float = Field(0.5, ge=0, le=1, description="scale of the logits of classes the client does not hold",
                             json_schema_extra=float_range(0.0, 1.0))
        scaling: Literal["presence", "proportional"] = Field(
            "presence", description="presence: held classes 1, missing alpha (paper); proportional: "
            "alpha + (1 - alpha) n_c / max n (official code)")

    def client_update(self, rnd: int, cid: int, client: Any, message: Message, data: ClientData) -> ClientUpdate:
        scales = class_scales(data.class_counts, self.hyper.alpha, self.hyper.scaling)
        params = yield Fit(message["params"], loss=restricted_softmax_loss, context={"scales": scales})
        return client, {"params": params, "weight": data.n_train}
