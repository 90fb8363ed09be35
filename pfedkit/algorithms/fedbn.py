"""FedBN (Li, Jiang, Zhang, Kamp, Dou, ICLR 2021): FedAvg, except that every BatchNorm layer stays local.

The server averages every parameter that is not a BatchNorm layer's (FedAvg, n_i weights):

    w^{t+1, l} = sum_i n_i w_i^{t+1, l} / sum_i n_i        for each non-BatchNorm layer l     (1)

while each client keeps its BatchNorm layers' weight gamma_i and bias beta_i (client state) and,
as for every method in pfedkit, its BatchNorm running statistics (the engine's per-client buffers).
Neither is ever sent nor averaged. Round: the client receives the non-BatchNorm parameters, trains
(them + its own BatchNorm layers) with the run's local training, keeps its BatchNorm parameters and
uploads the rest with n_i. Evaluated model: the global non-BatchNorm parameters (1) + the client's
own BatchNorm parameters and statistics. Communication: |w| - |BN| down, |w| - |BN| + n_i up.

BatchNorm layers are found by type (every `torch.nn` BatchNorm1d/2d/3d, shortcut ones included), not
by name. On a model without BatchNorm this is FedAvg exactly: a ConfigWarning says so.
"""
from __future__ import annotations

import warnings
from functools import cached_property
from typing import Any

from torch import nn

from pfedkit.algorithms.registry import register
from pfedkit.core.aggregation import MeanOfUploads
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, Message
from pfedkit.core.errors import ConfigWarning
from pfedkit.core.params import Params, clone, merge


def batchnorm_parameter_names(model: nn.Module) -> frozenset[str]:
    """The names (as `model.named_parameters()` gives them) of every BatchNorm layer's weight and bias."""
    return frozenset(f"{layer_name}.{name}" for layer_name, layer in model.named_modules()
                     if isinstance(layer, nn.modules.batchnorm._BatchNorm)
                     for name, _ in layer.named_parameters(recurse=False))


def split_off(params: Params, names: frozenset[str]) -> tuple[Params, Params]:
    """(the entries not in `names`, the entries in `names`) of `params`."""
    return ({name: value for name, value in params.items() if name not in names},
            {name: value for name, value in params.items() if name in names})


@register
class FedBN(MeanOfUploads, Algorithm):
    """The server averages the non-BatchNorm parameters (`MeanOfUploads`, key "params")."""
    name = "fedbn"
    description = "FedBN: FedAvg of everything but the BatchNorm layers, which stay on each client"
    evaluated_model = "custom"  # global non-BatchNorm parameters + the client's own BatchNorm layers

    @cached_property
    def local_names(self) -> frozenset[str]:
        """The parameters that never leave a client: the BatchNorm layers' weights and biases."""
        return batchnorm_parameter_names(self.setup.ops.template)

    def check(self) -> None:
        if not self.local_names:
            warnings.warn("fedbn: the model has no BatchNorm layer, so FedBN runs as FedAvg; "
                          "use a model with BatchNorm (model=cnn_bn, resnet18)", ConfigWarning, stacklevel=2)

    def init_server(self, params: Params) -> dict[str, Any]:
        return {"params": clone(split_off(params, self.local_names)[0])}

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        return {"batchnorm": clone(split_off(params, self.local_names)[1])}

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        return {cid: {"params": server["params"]} for cid in cids}

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        params = yield Fit(merge(message["params"], client["batchnorm"]))
        shared, batchnorm = split_off(params, self.local_names)
        return {"batchnorm": batchnorm}, {"params": shared, "weight": data.n_train}

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        return merge(server["params"], client["batchnorm"])
