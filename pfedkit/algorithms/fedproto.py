"""FedProto (Tan, Long, Liu, Zhou, Lu, Jiang, Zhang, *FedProto: Federated Prototype Learning across
Heterogeneous Clients*, AAAI 2022; spec baselines.md "FedProto").

FedProto runs the class-feature exchange it shares with pFedPM (`prototype_exchange.py`: eq. 6
class means, eq. 7 global features, the feature messages, the server state) with the mixing
weight a = 0 (the target is the global prototype itself) and no relation head; this file holds
only its local loss (the shared `prototypes.alignment_loss`, FedProto's per-sample MSE, or the
paper's class distance) and its nearest-prototype prediction.

Round t:
  1. The server sends every global prototype it has, C̄_c (none before round 1).
  2. A participant trains its own model E epochs on CE + lam * MSE(f(x), C̄_y) (mean over the batch
     and the d dimensions); samples of a class without a global prototype contribute 0 (so round 1
     is plain cross-entropy).
  3. It uploads, per class it owns, the mean body output over its training samples of that class
     (one eval-mode pass after training) and the class's sample count.
  4. The server averages the uploads per class (`global_feature_weighting`); classes nobody uploaded
     this round keep their previous prototype. No model is aggregated.

Client state: its own model (never uploaded). Evaluated: the client's model, predicting by the
nearest global prototype, argmin_c ||f(x) - C̄_c||_2 (`prediction="prototype"`, the paper and PFLlib)
or with its own head (`prediction="head"`). Communication: up (#own classes) * d floats + one
count per class; down (#classes with a global prototype) * d floats (C * d once all exist).
Paper-vs-code table: docs/algorithms/fedproto.md.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Literal

import torch
from pydantic import Field

from pfedkit.algorithms.prototype_exchange import (GlobalFeatureWeighting, PrototypeExchange, PrototypeOptions,
                                                  global_feature_weighting, prototype_loss)
from pfedkit.algorithms.prototypes import alignment_loss
from pfedkit.algorithms.registry import register
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, Message
from pfedkit.core.params import Params, clone

NO_PROTOTYPE = float("-inf")  # "logit" of a class without a global prototype: never predicted


def prototype_logits(features: torch.Tensor, prototypes: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """Nearest-prototype scores: logits[b, c] = -||f(x_b) - C̄_c||_2 for classes with a global
    prototype, NO_PROTOTYPE (-inf) for the others, so argmax = argmin_c ||f(x_b) - C̄_c||."""
    distances = torch.cdist(features.float(), prototypes.float(), compute_mode="donot_use_mm_for_euclid_dist")
    return torch.where(present.unsqueeze(0), -distances, torch.full_like(distances, NO_PROTOTYPE))


@register
class FedProto(PrototypeExchange, Algorithm):
    name = "fedproto"
    description = "FedProto: clients share class prototypes (mean features), predict by the nearest global prototype"
    evaluated_model = "custom"  # own model, predicting by the nearest global prototype

    class Hyper(PrototypeOptions):
        """FedProto hyperparameters (baselines.md "FedProto"): the prototype options
        (`PrototypeOptions`: lam 1.0 as FedProto MNIST/FEMNIST, FedReMa and PFLlib; the paper uses
        0.1 on CIFAR-10), with the server's plain mean over uploaders as the default weighting (the
        reported results and lam values come from FedProto's code), and:

        prediction: "prototype" = nearest global prototype [paper, code: PFLlib]; "head" = the
           client's own classifier head.
        The mixing weight is fixed at a = 0 (the target is the global prototype), not an option.
        """
        global_feature_weighting: GlobalFeatureWeighting = global_feature_weighting("uniform")
        prediction: Literal["prototype", "head"] = Field(
            "prototype", description="predict by the nearest global prototype, or with the model's head")

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        """Only the client's own model: with a = 0 its previous prototypes are never used."""
        return {"params": clone(params)}

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        """Train on CE + lam * R against the received global prototypes (a = 0: every class with a
        global prototype is regularised, also on a client's first participation), then upload
        the class means of the trained body's outputs and the counts."""
        prototypes, present = self.received(message)
        if self.hyper.regulariser == "sample_mse":
            request = Fit(client["params"], loss=partial(alignment_loss, lambda_f=self.hyper.lam),
                          context={"prototypes": torch.where(present.unsqueeze(1), prototypes, torch.nan)})
        else:
            request = Fit(client["params"],
                          loss=partial(prototype_loss, lam=self.hyper.lam, regulariser=self.hyper.regulariser),
                          context={"mixed": prototypes, "has_mixed": present})
        params = yield request
        _, means, counts = self.local_features(params, data)
        return {"params": params}, self.upload(means, counts)

    def predict(self, cid: int, server: dict, client: dict, features: torch.Tensor) -> torch.Tensor:
        """Nearest global prototype (server state after the round's aggregation); the model's head
        with `prediction="head"` or while no global prototype exists yet."""
        if self.hyper.prediction == "head" or not bool(server["present"].any()):
            return self.setup.ops_for(cid).head_logits(client["params"], features)
        return prototype_logits(features, server["features"], server["present"])
