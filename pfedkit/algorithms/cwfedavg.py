"""cwFedAvg with WDR (Lee & Choi, ICCV 2025): one FedAvg per class, mixed per client.

Spec: shared/specs/seed-algorithms.md §3. The paper writes M clients and K classes; here N and C.

* The server keeps C class-wise global models w_j^G (eq. 5-6): FedAvg of the round's uploads,
  client i weighted by q_ij = p_i p~_ij / sum_i' p_i' p~_i'j, p_i = n_i / sum n.
* Client i's personalised model is w_i^L = sum_j p~_ij w_j^G (eq. 7).
* p~_i is never sent: the server reads it off the uploaded output layer, the normalised L2 norms
  of its weight rows (eq. 4). WDR adds lambda ||p_i - p~_i(W_i)||_2 to the local loss (eq. 8) so
  that this estimate follows the client's true class distribution p_i.
* Variant "output" (the paper's headline, default): only the output layer (weight + bias) is
  class-wise, every other layer is plain FedAvg. "all": every layer is class-wise. An integer L:
  the last L layers (Table 3; 1 = output).

Messages (spec §3.8, default mix_on="server"): down = the personalised model w_i^L (one model),
up = the trained model + n_i, the same bytes as FedAvg. mix_on="client" reproduces the authors'
code: the client downloads the shared layers and all C class-wise layers and mixes them itself.

Partial participation [ours]: eq. 6 runs over the round's participants; a class that none of
them holds (p~_ij < held_share / C for all of them) keeps its previous class-wise model instead
of an average of clients without it. Under full participation eq. 6 is the paper's, unchanged.
`check()` refuses, before the run directory exists, a class_wise_layers the model cannot take and
a model without a C-row output Linear layer.

Server state: {"shared": FedAvg layers, "class_wise": list of C dicts of the class-wise layers,
"class_dist": [N, C] the p~ (or p) the server last saw of each client, 1/C before any upload}.
Client state: None with mix_on="server"; {"class_dist": [C]} (what it mixes with) otherwise.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, PositiveInt

from pfedkit.algorithms.registry import register
from pfedkit.core.contract import (Algorithm, ClientData, ClientUpdate, cross_entropy, Fit, Forward, HyperParams, Message)
from pfedkit.core.errors import ConfigError
from pfedkit.core.params import Params, clone, weighted_mean
from pfedkit.core.search import float_range


# ---------------------------------------------------------------------------------------------
# The math (pure functions)
# ---------------------------------------------------------------------------------------------

def estimate_class_distribution(head_weight: torch.Tensor) -> torch.Tensor:
    """Eq. (4): p~_j = ||W_j||_2 / sum_k ||W_k||_2 over the rows of the output weight [C, d].

    Bias excluded [code]. Differentiable (WDR uses it on live weights). A matrix of zeros gives
    1/C for every class [ours]; written with `torch.where` so no NaN reaches the gradient.
    """
    if head_weight.dim() < 2:
        raise ValueError(f"estimate_class_distribution expects the output weight [C, d], got shape "
                         f"{tuple(head_weight.shape)}")
    row_norms = torch.linalg.vector_norm(head_weight.reshape(head_weight.shape[0], -1), dim=1)
    total = row_norms.sum()
    positive = total > 0
    safe_total = torch.where(positive, total, torch.ones_like(total))
    uniform = torch.full_like(row_norms, 1.0 / row_norms.shape[0])
    return torch.where(positive, row_norms / safe_total, uniform)


def weight_distribution_regularizer(head_weight: torch.Tensor, class_distribution: torch.Tensor) -> torch.Tensor:
    """Eq. (8): R_i = ||p_i - p~_i(W_i)||_2 (Euclidean norm, not squared)."""
    target = class_distribution.to(head_weight.dtype)
    return torch.linalg.vector_norm(target - estimate_class_distribution(head_weight))


def wdr_loss(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any], *,
             coefficient: float, output_weight: str) -> torch.Tensor:
    """Local loss with WDR: CE + coefficient * R_i (coefficient = lambda, or lambda/2 [code]).

    context["class_distribution"] = p_i, the client's empirical class distribution [C];
    `output_weight` names the output layer's weight in `params` (the live parameters).
    """
    loss = cross_entropy(out, y, params, context)
    if coefficient == 0:
        return loss
    return loss + coefficient * weight_distribution_regularizer(params[output_weight], context["class_distribution"])


def class_wise_weights(class_dist: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eq. (6): q_ij = p_i p_ij / sum_i' p_i' p_i'j with p_i = n_i / sum_i' n_i'.

    Returns (q [N, C], has_mass [C]); a class no client carries any mass for (sum = 0) has a
    column of zeros and has_mass False. Every column with mass sums to 1.
    """
    class_dist = np.asarray(class_dist, dtype=np.float64)
    sizes = np.asarray(sizes, dtype=np.float64).reshape(-1)
    if class_dist.ndim != 2 or class_dist.shape[0] != sizes.shape[0]:
        raise ValueError(f"class_dist must be [N, C] with N = len(sizes) = {sizes.shape[0]}, "
                         f"got shape {class_dist.shape}")
    if (class_dist < 0).any() or (sizes < 0).any():
        raise ValueError("class distributions and sizes must be non-negative")
    total = sizes.sum()
    client_share = sizes / total if total > 0 else np.zeros_like(sizes)
    mass = client_share[:, None] * class_dist
    column = mass.sum(axis=0)
    has_mass = column > 0
    q = np.divide(mass, column[None, :], out=np.zeros_like(mass), where=has_mass[None, :])
    return q, has_mass


def class_wise_models(params: Sequence[Params], class_dist: np.ndarray, sizes: np.ndarray,
                      previous: Sequence[Params] | None = None, keep: np.ndarray | None = None) -> list[Params]:
    """Eq. (5)-(6): the C class-wise global models w_j^G = sum_i q_ij w_i.

    params: the N uploaded state dicts (any common subset of layers); class_dist [N, C]: p~ (or
    the empirical p) of each; sizes [N]: n_i. A class without mass, or marked in `keep` [C] bool,
    keeps `previous[j]` [ours]; without `previous` that is an error.
    """
    if not params:
        raise ValueError("class_wise_models needs at least one uploaded model")
    q, has_mass = class_wise_weights(class_dist, sizes)
    averaged = has_mass if keep is None else has_mass & ~np.asarray(keep, dtype=bool)
    models = []
    for j in range(q.shape[1]):
        if averaged[j]:
            contributors = np.flatnonzero(q[:, j] > 0)
            models.append(weighted_mean([params[i] for i in contributors], q[contributors, j]))
        elif previous is not None:
            models.append(previous[j])
        else:
            raise ValueError(f"class {j} has zero aggregation mass (no client carries it) or is marked "
                             "to keep; pass previous= to keep its last model")
    return models


def unheld_classes(class_dist: np.ndarray, held_share: float) -> np.ndarray:
    """Classes no client of `class_dist` [N, C] holds [ours]: p_ij < held_share / C for every i.

    A client "holds" class j when its (estimated) share of j is at least `held_share` times the
    uniform share 1/C (held_share = 1: at least 1/C; 0: every class is held). Returns [C] bool.
    """
    class_dist = np.asarray(class_dist, dtype=np.float64)
    return (class_dist < held_share / class_dist.shape[1]).all(axis=0)


def personalised_model(class_models: Sequence[Params], class_dist: np.ndarray | torch.Tensor) -> Params:
    """Eq. (7): w_i^L = sum_j p~_ij w_j^G, for one client's distribution [C] (sums to 1)."""
    if isinstance(class_dist, torch.Tensor):
        class_dist = class_dist.detach().cpu().numpy()
    weights = np.asarray(class_dist, dtype=np.float64).reshape(-1)
    if weights.shape[0] != len(class_models):
        raise ValueError(f"{len(class_models)} class-wise models but a distribution over {weights.shape[0]} classes")
    mixed: Params = {}
    for name, first in class_models[0].items():
        acc = torch.zeros_like(first)
        for weight, model in zip(weights, class_models):
            if weight != 0:
                acc.add_(model[name], alpha=float(weight))
        mixed[name] = acc
    return mixed


def empirical_distribution(class_counts: np.ndarray) -> np.ndarray:
    """p_ij = n_ij / n_i (rows of zeros stay zero)."""
    counts = np.asarray(class_counts, dtype=np.float64)
    totals = counts.sum(axis=-1, keepdims=True)
    return np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)


# ---------------------------------------------------------------------------------------------
# Which layers are class-wise
# ---------------------------------------------------------------------------------------------

def layer_of(name: str) -> str:
    """`head.fc.weight` -> `head.fc` (a layer = the parameters sharing a module prefix)."""
    return name.rsplit(".", 1)[0]


def output_weight_name(params: Params) -> str:
    """Name of the output layer's weight: the last 2-D `head.*.weight` entry."""
    names = [n for n, v in params.items() if n.startswith("head.") and n.endswith(".weight") and v.dim() >= 2]
    if not names:
        raise ValueError("cwfedavg needs an output Linear layer in the head (no 2-D head.*.weight found)")
    return names[-1]


def model_layers(params: Params) -> list[str]:
    """The layers with parameters, in model order (unique module prefixes)."""
    return list(dict.fromkeys(layer_of(n) for n in params))


def class_wise_names(params: Params, class_wise_layers: str | int) -> list[str]:
    """Parameter names aggregated class-wise: the last L layers ("output" = 1, "all" = every one)."""
    layers = model_layers(params)
    if class_wise_layers == "all":
        chosen = set(layers)
    else:
        count = 1 if class_wise_layers == "output" else int(class_wise_layers)
        if count > len(layers):
            raise ValueError(f"cwfedavg.class_wise_layers={class_wise_layers}: the model has only "
                             f"{len(layers)} layers with parameters ({', '.join(layers)}); use a "
                             f"number up to {len(layers)} or 'all'")
        chosen = set(layers[-count:])
    if layer_of(output_weight_name(params)) not in chosen:
        raise ValueError("cwfedavg: the class-wise layers must include the output layer")
    return [n for n in params if layer_of(n) in chosen]


def short_list(names: Sequence[str], limit: int = 6) -> str:
    """`a, b, c` or, for long lists, `a, b, ..., y, z` (for one-line error messages)."""
    if len(names) <= limit:
        return ", ".join(names)
    return ", ".join([*names[:2], "...", *names[-2:]])


def model_mismatch(params: Params, num_classes: int, class_wise_layers: str | int, model: str) -> str | None:
    """Why the options cannot run on this model (one ConfigError line), or None when they fit."""
    try:
        output = output_weight_name(params)
    except ValueError:
        return (f"model: {model} has no output Linear layer in its head (no 2-D head.*.weight); cwfedavg "
                "reads the class distribution off its rows (eq. 4); use a model whose head ends in a Linear layer")
    rows = params[output].shape[0]
    if rows != num_classes:
        return (f"model: the output layer {output} of {model} has {rows} rows but the data has "
                f"{num_classes} classes; cwfedavg needs one row per class (eq. 4); build the model with "
                f"{num_classes} outputs")
    layers = model_layers(params)
    count = {"output": 1, "all": len(layers)}.get(class_wise_layers, class_wise_layers)
    if count > len(layers):
        return (f"cwfedavg.class_wise_layers: {count} but {model} has only {len(layers)} layers with "
                f"parameters ({short_list(layers)}); allowed: 1..{len(layers)}, 'output' or 'all'; "
                f"set cwfedavg.class_wise_layers={len(layers)} (= all) or less")
    if layer_of(output) not in layers[-count:]:
        return (f"cwfedavg.class_wise_layers: the last {count} layers of {model} "
                f"({short_list(layers[-count:])}) do not include its output layer {layer_of(output)}; "
                "the output layer must be class-wise; use 'all' or a larger number")
    return None


# ---------------------------------------------------------------------------------------------
# The algorithm
# ---------------------------------------------------------------------------------------------

@register
class CwFedAvg(Algorithm):
    name = "cwfedavg"
    description = "cwFedAvg + WDR: class-wise FedAvg, personalised mix by estimated class distribution"
    evaluated_model = "custom"  # shared layers + the class-wise models mixed by the client's p~
    head = "last"

    class Hyper(HyperParams):
        """cwFedAvg hyperparameters (spec §3.7, §3.9).

        class_wise_layers: "output" (headline variant, = 1), "all" (basic algorithm), or L = the
            last L layers with parameters (Table 3).
        wdr: add the Weight Distribution Regulariser to the local loss.
        wdr_lambda: lambda (paper: 10 MNIST/CIFAR-10, 1000 CIFAR-100, 2000 Tiny ImageNet).
        wdr_half_factor: apply 0.5 * lambda as the authors' code does (paper: lambda). The paper's
            lambda values were tuned with the code, so reproduction runs should set it.
        distribution: "approx" (p~ from the output weights, eq. 4) or "empirical" (true p_i, sent
            by the client in its reply: C extra floats up; code -gt ablation).
        empirical_from: counts behind p_i for WDR and distribution=empirical: "train" (spec) or
            "train_and_test" (the code uses the client's whole data).
        mix_on: "server" (paper: the server mixes eq. 7 with its stored p~ and sends one model) or
            "client" (code: the client downloads all C class-wise layers + shared layers and mixes
            with the p~ of its own last trained model).
        initial_distribution: p~ before a client's first upload: "uniform" 1/C (paper) or
            "initial_model" (eq. 4 on the initial weights, code).
        held_share: partial participation only [ours]: a participant holds class j when its p~_ij
            (p_ij with distribution=empirical) is at least held_share / C (1: the uniform share); a
            class that no participant of the round holds keeps its previous class-wise model instead
            of an eq. 6 average of clients without it. 0: eq. 6 over the participants for every
            class with mass (only zero-mass classes keep, the behaviour before this option). Under
            full participation eq. 6 is used as the paper writes it, whatever held_share.
        """
        class_wise_layers: Literal["output", "all"] | PositiveInt = Field(
            "output", description="'output', 'all', or the number of last layers aggregated class-wise")
        wdr: bool = Field(True, description="use the Weight Distribution Regulariser")
        wdr_lambda: float = Field(10.0, ge=0, description="WDR coefficient lambda",
                                  json_schema_extra=float_range(0.1, 100.0, log=True))
        wdr_half_factor: bool = Field(False, description="apply 0.5*lambda like the authors' code")
        distribution: Literal["approx", "empirical"] = Field("approx", description="p~ (eq. 4) or true p")
        empirical_from: Literal["train", "train_and_test"] = Field("train", description="counts behind p_i")
        mix_on: Literal["server", "client"] = Field("server", description="who forms the eq. 7 mixture")
        initial_distribution: Literal["uniform", "initial_model"] = Field("uniform", description="p~ before any upload")
        held_share: float = Field(1.0, ge=0, le=1, description="partial participation: a class no participant "
                                  "holds (p~_ij >= held_share/C) keeps its previous class-wise model")

    # -- helpers --------------------------------------------------------------------------------

    def wdr_coefficient(self) -> float:
        if not self.hyper.wdr:
            return 0.0
        return 0.5 * self.hyper.wdr_lambda if self.hyper.wdr_half_factor else self.hyper.wdr_lambda

    def starting_distribution(self, params: Params) -> torch.Tensor:
        num_classes = self.setup.num_classes
        if self.hyper.initial_distribution == "initial_model":
            return estimate_class_distribution(params[output_weight_name(params)]).detach().double()
        return torch.full((num_classes,), 1.0 / num_classes, dtype=torch.float64)

    def client_distribution(self, data: ClientData) -> np.ndarray:
        """p_i of the client, from its own counts (never leaves the client unless 'empirical')."""
        counts = np.asarray(data.class_counts, dtype=np.float64)
        if self.hyper.empirical_from == "train_and_test":
            counts = counts + np.bincount(data.y_test.numpy(), minlength=counts.shape[0])
        return empirical_distribution(counts)

    # -- hooks ----------------------------------------------------------------------------------

    def check(self) -> None:
        """Refuse options that do not fit the run's model (one ConfigError line)."""
        template = self.setup.ops.template
        problem = model_mismatch(dict(template.named_parameters()), self.setup.num_classes,
                                 self.hyper.class_wise_layers, type(template).__name__)
        if problem is not None:
            raise ConfigError(problem)

    def init_server(self, params: Params) -> dict[str, Any]:
        cw_names = class_wise_names(params, self.hyper.class_wise_layers)
        class_part = {n: params[n] for n in cw_names}
        start = self.starting_distribution(params)
        return {
            "shared": clone({n: v for n, v in params.items() if n not in class_part}),
            "class_wise": [clone(class_part) for _ in range(self.setup.num_classes)],
            "class_dist": start.repeat(self.setup.num_clients, 1),
        }

    def init_client(self, cid: int, params: Params) -> dict[str, Any] | None:
        if self.hyper.mix_on == "server":
            return None  # the client keeps nothing between rounds (spec §3.5)
        return {"class_dist": self.starting_distribution(params)}

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        if self.hyper.mix_on == "client":
            # the code sends every client all C class-wise layers plus the FedAvg layers
            return {cid: {"shared": server["shared"], "class_wise": server["class_wise"]} for cid in cids}
        return {cid: {"params": self.client_model(cid, server, None)} for cid in cids}

    def client_update(self, rnd: int, cid: int, client: Any, message: Message, data: ClientData) -> ClientUpdate:
        if self.hyper.mix_on == "client":
            mixing = client["class_dist"]
            if self.hyper.distribution == "empirical":
                mixing = torch.as_tensor(self.client_distribution(data))
            params = {**message["shared"], **personalised_model(message["class_wise"], mixing)}
        else:
            params = message["params"]
        own_distribution = torch.as_tensor(self.client_distribution(data), dtype=torch.float32)
        coefficient = self.wdr_coefficient()
        loss = (partial(wdr_loss, coefficient=coefficient, output_weight=output_weight_name(params))
                if coefficient > 0 else cross_entropy)
        trained = yield Fit(params, loss=loss, context={"class_distribution": own_distribution})
        reply: Message = {"params": trained, "weight": data.n_train}
        if self.hyper.distribution == "empirical":
            reply["class_distribution"] = own_distribution  # the server cannot know it otherwise
        if self.hyper.mix_on == "server":
            return None, reply
        if self.hyper.distribution == "empirical":
            next_mixing = own_distribution.double()
        else:
            next_mixing = estimate_class_distribution(trained[output_weight_name(trained)]).detach().double()
        return {"class_dist": next_mixing}, reply

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        """Algorithm 1 lines 8-9: p~ of every upload (eq. 4), class-wise models (eq. 6), FedAvg layers."""
        self.record_true_distribution(rnd)
        cids = sorted(c for c in replies if replies[c]["weight"] > 0)  # n_i = 0 clients are excluded
        if not cids:
            return server
        uploads = [replies[c]["params"] for c in cids]
        sizes = np.array([float(replies[c]["weight"]) for c in cids])
        estimated, used = self.upload_distributions(replies, cids)
        keep = self.classes_to_keep(used, sizes, full=len(replies) == self.setup.num_clients)
        cw_names = list(server["class_wise"][0])
        class_models = class_wise_models([{n: u[n] for n in cw_names} for u in uploads], used, sizes,
                                         previous=server["class_wise"], keep=keep)
        shared_names = list(server["shared"])
        shared = (weighted_mean([{n: u[n] for n in shared_names} for u in uploads], sizes)
                  if shared_names else {})
        class_dist = server["class_dist"].clone()
        class_dist[cids] = torch.as_tensor(used, dtype=class_dist.dtype)
        self.record_estimates(rnd, cids, estimated)
        self.record(rnd, "kept_class_models", np.flatnonzero(keep))
        return {"shared": shared, "class_wise": class_models, "class_dist": class_dist}

    def upload_distributions(self, replies: dict[int, Message], cids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(p~ of each upload by eq. 4, the distribution eq. 6-7 use: p~ or the sent empirical p), [P, C]."""
        out_name = output_weight_name(replies[cids[0]]["params"])
        estimated = np.stack([estimate_class_distribution(replies[c]["params"][out_name]).double().numpy()
                              for c in cids])
        if self.hyper.distribution != "empirical":
            return estimated, estimated
        sent = np.stack([np.asarray(replies[c]["class_distribution"], dtype=np.float64) for c in cids])
        return estimated, sent

    def classes_to_keep(self, used: np.ndarray, sizes: np.ndarray, full: bool) -> np.ndarray:
        """[C] bool: classes whose class-wise model stays as it was this round [ours].

        Zero eq. 6 mass always; under partial participation also every class no participant holds
        (`unheld_classes` with `held_share`). Full participation: eq. 6 exactly as the paper.
        """
        no_mass = ~class_wise_weights(used, sizes)[1]
        return no_mass if full else no_mass | unheld_classes(used, self.hyper.held_share)

    def client_model(self, cid: int, server: dict, client: Any) -> Params:
        mixing = client["class_dist"] if self.hyper.mix_on == "client" else server["class_dist"][cid]
        return {**server["shared"], **personalised_model(server["class_wise"], mixing)}

    # -- diagnostics ----------------------------------------------------------------------------

    def record_true_distribution(self, rnd: int) -> None:
        """The true training distribution, once, for comparison only (never used by the method)."""
        if "true_class_distribution" not in self.diagnostics:
            self.record(rnd, "true_class_distribution", empirical_distribution(self.setup.train_counts))

    def record_estimates(self, rnd: int, cids: list[int], estimated: np.ndarray) -> None:
        """p~ (eq. 4) of every participant's upload; NaN rows for clients that did not take part."""
        table = np.full((self.setup.num_clients, self.setup.num_classes), np.nan)
        table[cids] = estimated
        self.record(rnd, "estimated_class_distribution", table)
