"""FedAvg-FT: FedAvg, each client fine-tuning a copy of the global model before it is evaluated.

The "FedAvg + fine-tuning" baseline of personalised FL benchmarks (pFL-Bench's FedAvg-FT,
FederatedScope `trainer.finetune.before_eval`). Training is FedAvg's, unchanged: one global model,
n_i-weighted mean of the participants' trained models. Evaluation (`Algorithm.adapt`): before each
evaluation client i starts from the global model w and takes `finetune_steps` mini-batch SGD steps
(lr `finetune_lr`) on its own training split (or `finetune_epochs` epochs when set),

    w_i = w - eta_ft sum_{s < S} grad F_i(w_i^(s); B_s),        w_i^(0) = w,                (1)

and is evaluated with w_i; the copy is thrown away, so fine-tuning never changes training.
Defaults [code: pFL-Bench]: S = 5 mini-batches at eta_ft = 0.01 before every evaluation.
`finetune_epochs=0` evaluates w as is: exactly FedAvg. Communication: FedAvg's (the model down,
the model + n_i up); fine-tuning is local.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from pfedkit.algorithms.fedavg import FedAvg
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import Fit, HyperParams
from pfedkit.core.params import Params
from pfedkit.core.search import float_range, int_range


@register
class FedAvgFT(FedAvg):
    name = "fedavgft"
    description = "FedAvg-FT: FedAvg training; each client fine-tunes a copy of the global model before evaluation"
    evaluated_model = "custom"  # the global model after the client's fine-tuning (eq. 1)

    class Hyper(HyperParams):
        """Fine-tuning before evaluation (defaults: pFL-Bench's FedAvg-FT, FederatedScope
        `trainer.finetune.steps` = 5 mini-batches, `trainer.finetune.lr` = 0.01)."""
        finetune_steps: int = Field(5, ge=0, description="S: mini-batch SGD steps of fine-tuning before each "
                                    "evaluation (0: evaluate the global model as is)",
                                    json_schema_extra=int_range(1, 100, log=True))
        finetune_epochs: int | None = Field(None, ge=0, description="fine-tune this many epochs instead of "
                                            "finetune_steps (0: evaluate the global model as is)")
        finetune_lr: float | None = Field(0.01, gt=0, description="eta_ft: fine-tuning learning rate "
                                          "(null: the run's lr)", json_schema_extra=float_range(0.001, 0.1, log=True))
        finetune_part: Literal["all", "head"] = Field("all", description="what fine-tuning trains: the whole "
                                                      "model or the head only (body frozen)")

    def adapt(self, cid: int, server: dict, client: None, params: Params) -> Fit | None:
        """Eq. (1) from the global model; None (no fine-tuning) when its length is 0."""
        hyper = self.hyper
        epochs, steps = hyper.finetune_epochs, hyper.finetune_steps
        if (steps if epochs is None else epochs) == 0:
            return None
        length = {"steps": steps} if epochs is None else {"epochs": epochs}
        return Fit(params, trainable=hyper.finetune_part, lr=hyper.finetune_lr, **length)
