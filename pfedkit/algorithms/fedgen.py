"""FedGen (Zhu, Hong, Zhou, *Data-Free Knowledge Distillation for Heterogeneous Federated
Learning*, ICML 2021): FedAvg plus a server-side generator of head inputs, learnt from the
ensemble of the participants' heads, that regularises the clients' training.

The generator G_w(y, eps) -> z in R^d (d: the head's input size) is an MLP [eps, onehot(y)] ->
Linear -> BatchNorm -> ReLU -> Linear (the FedGen code's, `GENERATORCONFIGS`); eps ~ N(0, I)
(`noise="gaussian"` [paper]) or U(0, 1) (`"uniform"` [code: FedGen, PFLlib]).

Round t (participants P_t, rounds counted from 1):
  1. download the global model theta and (from round 2) the generator w (with its BatchNorm
     statistics);
  2. the client trains theta E epochs on (eq. 5 of the paper, with the code's two terms)
        L = CE(h(f(x)), y) + alpha_t CE(h(G(yhat, eps')), yhat) + beta_t KL(softmax(h(G(y, eps))) || softmax(h(f(x))))
     yhat drawn uniformly from the `client_labels`, one (yhat, eps', eps) per training sample and
     round (the generator in eval mode); alpha_t = max(1e-4, alpha * decay^(t-1)), likewise
     beta_t [code]; round 1 is plain cross-entropy [code: `regularization=glob_iter > 0`];
  3. upload theta_i, n_i and the class counts n_i,c;
  4. server: theta = sum_i n_i theta_i / sum_i n_i (FedAvg); the generator takes
     `generator_steps` Adam steps (lr `generator_lr * decay^(t-1)`, L2 `generator_weight_decay`)
     on (eq. 4 with the code's weights and diversity term)
        J(w) = sum_k mean_b w_k(y_b) CE(h_k(G(y_b, eps_b)), y_b) + eta * L_div
     with y_b uniform over the labels some participant holds more than once, w_k(y) =
     n_k,y / sum_{j in P_t} n_j,y (the label-count ensemble weights), h_k the participants' trained
     heads (the teachers), and the diversity loss
        L_div = exp( -mean_{a,b} [ mean_l (eps_a,l - eps_b,l)^2 * mean_m |G_a,m - G_b,m| ] ).

Server state: theta, w (+ BatchNorm statistics), Adam's moments. Client state: none. Evaluated
model: the global model (FedAvg's). Communication: down |theta| + |w| (+ 2H statistics; round 1:
|theta|); up |theta| + n_i + C counts. The head must be one Linear layer (it is applied to the
generator's output by hand).
"""
from __future__ import annotations

from functools import partial
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from pfedkit.algorithms.creff import fresh_linear
from pfedkit.algorithms.registry import register
from pfedkit.core.aggregation import fedavg_aggregate
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, Forward, HyperParams, Message
from pfedkit.core.errors import ConfigError
from pfedkit.core.params import Params, clone, linear_layer_names, select
from pfedkit.core.search import float_range
from pfedkit.core.seeds import SERVER, torch_generator

BN_MOMENTUM, BN_EPS = 0.1, 1e-5  # torch's BatchNorm1d defaults (the FedGen generator's)
ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8  # the FedGen code's Adam
MIN_COEFFICIENT = 1e-4  # alpha_t, beta_t never decay below this [code: exp_lr_scheduler]
MIN_SAMPLES_PER_LABEL = 1  # a label trains the generator when some participant has more [code]


# ---------------------------------------------------------------------------------------------
# The generator (pure functions on plain tensors)


def init_generator(noise_dim: int, num_classes: int, hidden_dim: int, feature_dim: int,
                   generator: torch.Generator) -> tuple[Params, Params]:
    """(parameters, BatchNorm statistics) of G: Linear(noise + C, H) -> BN(H) -> ReLU -> Linear(H, d),
    PyTorch's default initialisation drawn from `generator`."""
    fc_w, fc_b = fresh_linear(noise_dim + num_classes, hidden_dim, generator)
    out_w, out_b = fresh_linear(hidden_dim, feature_dim, generator)
    params = {"fc.weight": fc_w, "fc.bias": fc_b, "bn.weight": torch.ones(hidden_dim),
              "bn.bias": torch.zeros(hidden_dim), "out.weight": out_w, "out.bias": out_b}
    return params, {"running_mean": torch.zeros(hidden_dim), "running_var": torch.ones(hidden_dim)}


def generate(params: Params, stats: Params, labels: torch.Tensor, noise: torch.Tensor, num_classes: int,
             training: bool) -> tuple[torch.Tensor, Params]:
    """G(y, eps) -> (features [B, d], BatchNorm statistics after the call). training=True: batch
    statistics, running ones updated (momentum 0.1, unbiased variance), as nn.BatchNorm1d in train
    mode; False: the running statistics, unchanged (eval mode)."""
    inputs = torch.cat([noise, F.one_hot(labels, num_classes).to(noise.dtype)], dim=1)
    hidden = F.linear(inputs, params["fc.weight"], params["fc.bias"])
    mean, var = stats["running_mean"].clone(), stats["running_var"].clone()
    hidden = F.batch_norm(hidden, mean, var, params["bn.weight"], params["bn.bias"], training=training,
                          momentum=BN_MOMENTUM, eps=BN_EPS)
    features = F.linear(torch.relu(hidden), params["out.weight"], params["out.bias"])
    return features, {"running_mean": mean, "running_var": var}


def draw_noise(count: int, dim: int, kind: str, generator: torch.Generator) -> torch.Tensor:
    """eps: N(0, I) ("gaussian", the paper) or U(0, 1) per entry ("uniform", the FedGen code's torch.rand)."""
    if kind == "gaussian":
        return torch.randn(count, dim, generator=generator)
    return torch.rand(count, dim, generator=generator)


def diversity_loss(noise: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """L_div = exp(-mean_{a,b} D_eps(a, b) D_G(a, b)), D_eps the mean squared difference of the
    noises, D_G the mean absolute difference of the generated features [code: DiversityLoss('l1')]."""
    noise_distance = (noise.unsqueeze(1) - noise.unsqueeze(0)).pow(2).mean(dim=-1)
    feature_distance = (features.unsqueeze(1) - features.unsqueeze(0)).abs().mean(dim=-1)
    return torch.exp(-(noise_distance * feature_distance).mean())


def label_weights(counts: torch.Tensor) -> torch.Tensor:
    """w_k(y) = n_k,y / sum_j n_j,y over the teachers k ([K, C] counts -> [K, C]; 0 where nobody has y)."""
    counts = counts.double()
    return (counts / counts.sum(dim=0, keepdim=True).clamp(min=1e-300)).float()


def teacher_loss(features: torch.Tensor, labels: torch.Tensor, heads: list[tuple[torch.Tensor, torch.Tensor | None]],
                 weights: torch.Tensor, form: str) -> torch.Tensor:
    """The ensemble's loss on generated features, weights [K, C]:
    "weighted_ce": sum_k mean_b w_k(y_b) CE(h_k(z_b), y_b) [code: FedGen, FL-bench];
    "ensemble_ce": mean_b CE(sum_k w_k(y_b) h_k(z_b), y_b) (the CE of the weighted ensemble logits:
    the paper's sigma(ensemble) form with label weights; PFLlib uses n_k weights)."""
    per_label = weights[:, labels]  # [K, B]
    logits = [F.linear(features, weight, bias) for weight, bias in heads]
    if form == "ensemble_ce":
        mixed = sum(w.unsqueeze(1) * z for w, z in zip(per_label, logits))
        return F.cross_entropy(mixed, labels)
    return sum((w * F.cross_entropy(z, labels, reduction="none")).mean() for w, z in zip(per_label, logits))


def adam_step(params: Params, grads: Params, moments: dict[str, Any], lr: float, weight_decay: float
              ) -> tuple[Params, dict[str, Any]]:
    """One step of torch.optim.Adam (L2 weight decay added to the gradient, bias-corrected moments):
    m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2, p -= lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)."""
    b1, b2 = ADAM_BETAS
    step = int(moments["step"]) + 1
    new_params, m_new, v_new = {}, {}, {}
    for name, value in params.items():
        grad = grads[name] + weight_decay * value
        m_new[name] = b1 * moments["m"][name] + (1 - b1) * grad
        v_new[name] = b2 * moments["v"][name] + (1 - b2) * grad * grad
        denominator = (v_new[name] / (1 - b2 ** step)).sqrt() + ADAM_EPS
        new_params[name] = value - lr * (m_new[name] / (1 - b1 ** step)) / denominator
    return new_params, {"step": step, "m": m_new, "v": v_new}


def decayed(initial: float, decay: float, rnd: int) -> float:
    """The coefficient of round rnd (from 1): max(1e-4, initial * decay^(rnd - 1)) [code]."""
    return max(MIN_COEFFICIENT, initial * decay ** (rnd - 1))


# ---------------------------------------------------------------------------------------------
# The client's loss


def fedgen_loss(out: Forward, y: torch.Tensor, params: Params, context: dict[str, torch.Tensor], *, alpha: float,
                beta: float, weight_name: str, bias_name: str | None) -> torch.Tensor:
    """CE(h(f(x)), y) + alpha CE(h(G(yhat)), yhat) + beta KL(softmax(h(G(y))) || softmax(h(f(x)))).

    context (per training sample, read at Forward.index): "sampled" [n, d] = G(yhat, eps') with
    "sampled_labels" [n] = yhat, and "same" [n, d] = G(y, eps) for the sample's own label. The head
    h is the live head (the Linear `weight_name`, `bias_name`); the KL target is detached [code]."""
    weight, bias = params[weight_name], (params[bias_name] if bias_name else None)
    loss = F.cross_entropy(out.logits, y)
    sampled = F.linear(context["sampled"][out.index], weight, bias)
    loss = loss + alpha * F.cross_entropy(sampled, context["sampled_labels"][out.index])
    target = torch.softmax(F.linear(context["same"][out.index], weight, bias), dim=1).detach()
    return loss + beta * F.kl_div(torch.log_softmax(out.logits, dim=1), target, reduction="batchmean")


# ---------------------------------------------------------------------------------------------
# The algorithm


@register
class FedGen(Algorithm):
    name = "fedgen"
    description = "FedGen: FedAvg + a server generator of head inputs, distilled from the heads, regularising clients"
    evaluated_model = "global"
    head = "last"
    quick_test_options = {"generator_steps": 2}

    class Hyper(HyperParams):
        """FedGen options (defaults: the FedGen code's MNIST `RUNCONFIGS` / `GENERATORCONFIGS`).

        alpha / beta: initial weights of the client's generated-sample CE and latent KL terms
            (`generative_alpha` 10, `generative_beta` 10) [code]; decay: their factor per round
            (0.98) [code], also the generator lr's (`ExponentialLR(gamma=0.98)`).
        generator_steps / generator_batch_size: Adam steps of the server per round and labels per
            step (`ensemble_epochs` 50; the run's batch size 32 in the code: algorithms cannot read
            it, set it to match) [code]. generator_lr, generator_weight_decay (3e-4, 1e-2) [code].
        eta: weight of the diversity loss (`ensemble_eta` 1) [code]; 0 drops it (FL-bench's default).
        hidden_dim / noise_dim: the generator's sizes (256, 32) [code: MNIST]; its output size is
            the head's input size.
        noise: eps ~ N(0, I) [paper, FL-bench] or U(0, 1) [code: FedGen, PFLlib].
        client_labels: yhat uniform over every class [code: FedGen's `available_labels`] or over
            the client's own classes [FL-bench].
        teacher_loss: see `teacher_loss` ("weighted_ce" [code], "ensemble_ce").
        """
        alpha: float = Field(10.0, ge=0, description="initial weight of the CE on generated features (client)",
                             json_schema_extra=float_range(0.1, 20.0, log=True))
        beta: float = Field(10.0, ge=0, description="initial weight of the KL to the head on generated features "
                            "(client)", json_schema_extra=float_range(0.1, 20.0, log=True))
        decay: float = Field(0.98, gt=0, le=1, description="per-round decay of alpha, beta and the generator lr")
        generator_steps: int = Field(50, ge=0, description="Adam steps of the generator per round (server)")
        generator_batch_size: int = Field(32, ge=2, description="labels drawn per generator step")
        generator_lr: float = Field(3e-4, gt=0, description="Adam learning rate of the generator")
        generator_weight_decay: float = Field(1e-2, ge=0, description="Adam L2 weight decay of the generator")
        eta: float = Field(1.0, ge=0, description="weight of the generator's diversity loss")
        hidden_dim: int = Field(256, ge=1, description="generator hidden width")
        noise_dim: int = Field(32, ge=1, description="generator noise size")
        noise: Literal["gaussian", "uniform"] = Field("gaussian", description="noise N(0, I) (paper) or U(0, 1) "
                                                      "(FedGen code, PFLlib)")
        client_labels: Literal["all", "own"] = Field("all", description="labels of the client's generated "
                                                     "samples: every class (code) or its own (FL-bench)")
        teacher_loss: Literal["weighted_ce", "ensemble_ce"] = Field(
            "weighted_ce", description="label-weighted sum of the heads' CEs (code) or CE of the label-weighted "
            "ensemble logits")

    def __init__(self, hyper: HyperParams, setup) -> None:
        super().__init__(hyper, setup)
        head = dict(setup.ops.template.head.named_parameters(prefix="head"))
        try:
            self.weight_name, self.bias_name = linear_layer_names(head, "head")
        except ValueError:
            self.weight_name = self.bias_name = None  # refused by check()
        self.feature_dim = int(setup.ops.template.feature_dim)

    def check(self) -> None:
        if self.weight_name is None:
            raise ConfigError("fedgen applies the head to generated features by hand, so the model's head must be "
                              "one Linear layer (use head_split=last)")

    # --- state ---------------------------------------------------------------------------------

    def init_server(self, params: Params) -> dict[str, Any]:
        h = self.hyper
        generator, stats = init_generator(h.noise_dim, self.setup.num_classes, h.hidden_dim, self.feature_dim,
                                          torch_generator(self.setup.seed, 0, SERVER, "fedgen-init"))
        zeros = {name: torch.zeros_like(value) for name, value in generator.items()}
        return {"params": clone(params), "generator": generator, "generator_stats": stats,
                "adam": {"step": 0, "m": zeros, "v": clone(zeros)}}

    # --- round ---------------------------------------------------------------------------------

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        down = {"params": server["params"]}
        if rnd > 1:  # round 1 trains on cross-entropy only: no generator to send yet
            down.update(generator=server["generator"], generator_stats=server["generator_stats"])
        return {cid: down for cid in cids}

    def client_update(self, rnd: int, cid: int, client: Any, message: Message, data: ClientData) -> ClientUpdate:
        if "generator" in message and data.n_train:
            loss = partial(fedgen_loss, alpha=decayed(self.hyper.alpha, self.hyper.decay, rnd),
                           beta=decayed(self.hyper.beta, self.hyper.decay, rnd), weight_name=self.weight_name,
                           bias_name=self.bias_name)
            request = Fit(message["params"], loss=loss, context=self.generated_context(rnd, cid, message, data))
        else:
            request = Fit(message["params"])
        params = yield request
        counts = torch.bincount(data.y_train, minlength=self.setup.num_classes)
        return client, {"params": params, "weight": data.n_train, "counts": counts}

    def generated_context(self, rnd: int, cid: int, message: Message, data: ClientData) -> dict[str, torch.Tensor]:
        """One (yhat, eps', eps) per training sample, the generator in eval mode: the Fit's context."""
        n, c = data.n_train, self.setup.num_classes
        rng = torch_generator(self.setup.seed, rnd, cid, "fedgen")
        labels = torch.arange(c) if self.hyper.client_labels == "all" else torch.unique(data.y_train)
        sampled_labels = labels[torch.randint(len(labels), (n,), generator=rng)]
        noise = draw_noise(2 * n, self.hyper.noise_dim, self.hyper.noise, rng)
        with torch.no_grad():
            sampled, _ = generate(message["generator"], message["generator_stats"], sampled_labels, noise[:n], c, False)
            same, _ = generate(message["generator"], message["generator_stats"], data.y_train, noise[n:], c, False)
        return {"sampled": sampled, "sampled_labels": sampled_labels, "same": same}

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        if not replies:
            return server
        return {**server, "params": fedavg_aggregate(replies), **self.train_generator(rnd, server, replies)}

    def train_generator(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        """`generator_steps` Adam steps on J(w) against the participants' trained heads."""
        h, ordered = self.hyper, sorted(replies)
        heads = [self.head_of(replies[cid]["params"]) for cid in ordered]
        counts = torch.stack([replies[cid]["counts"] for cid in ordered])
        weights, qualified = label_weights(counts), torch.nonzero(counts.max(dim=0).values > MIN_SAMPLES_PER_LABEL)[:, 0]
        generator, stats, adam = server["generator"], server["generator_stats"], server["adam"]
        if not len(qualified):
            return {}
        rng, lr = torch_generator(self.setup.seed, rnd, SERVER, "fedgen"), decayed(h.generator_lr, h.decay, rnd)
        teacher_values, diversity_values = [], []
        for _ in range(h.generator_steps):
            labels = qualified[torch.randint(len(qualified), (h.generator_batch_size,), generator=rng)]
            noise = draw_noise(h.generator_batch_size, h.noise_dim, h.noise, rng)
            live = {name: value.detach().requires_grad_(True) for name, value in generator.items()}
            features, stats = generate(live, stats, labels, noise, self.setup.num_classes, True)
            teacher = teacher_loss(features, labels, heads, weights, h.teacher_loss)
            diversity = diversity_loss(noise, features)
            grads = torch.autograd.grad(teacher + h.eta * diversity, list(live.values()))
            generator, adam = adam_step(generator, dict(zip(live, grads)), adam, lr, h.generator_weight_decay)
            teacher_values.append(float(teacher.detach()))
            diversity_values.append(float(diversity.detach()))
        if teacher_values:
            self.record(rnd, "generator_teacher_loss", float(np.mean(teacher_values)))
            self.record(rnd, "generator_diversity_loss", float(np.mean(diversity_values)))
        return {"generator": generator, "generator_stats": stats, "adam": adam}

    def head_of(self, params: Params) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A trained model's head as (W, b), frozen: the generator's teacher."""
        head = select(params, "head")
        return head[self.weight_name].detach(), (head[self.bias_name].detach() if self.bias_name else None)

    def client_model(self, cid: int, server: dict, client: Any) -> Params:
        return server["params"]
