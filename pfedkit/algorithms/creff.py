"""CReFF (Shang, Lu, Huang, Wang, IJCAI 2022): classifier re-training with federated features.

Code: `shangxinyi/CReFF-FL` (`main.py`); spec: baselines.md "CReFF". A global method: one model
(theta, phi) trained by FedAvg, plus a classifier phi_re re-trained on the server from synthetic
"federated features" F_c (m per class, d = feature size), which are learnt by gradient matching.

Round t (participants P_t):
  1. download (theta^t, phi^t) and phi_re; for every class c it owns, the client computes the
     classifier gradient g_{i,c} = grad_phi CE(g_phi(f_theta(x)), c) at phi = phi_re on a random
     batch of `grad_batch_size` class-c samples (body in eval mode, the client's BatchNorm
     statistics), `grad_repeats` times, averaged;
  2. ordinary local training from (theta^t, phi^t) (never from phi_re); upload the model, n_i and
     {c: g_{i,c}};
  3. server: FedAvg -> (theta^{t+1}, phi^{t+1}); g_bar_c = plain mean of g_{i,c} over the
     participants owning c; `feature_steps` steps of SGD (`feature_lr`) on F minimising
     sum_c D(grad_phi CE(g_phi(F_c), c)|phi_re, g_bar_c), D = sum over output rows of (1 - cos)
     (bias as one row, `match_bias`);
  4. a freshly initialised Linear classifier is trained on {(F_c, c)} for `retrain_epochs` epochs
     of SGD (`retrain_lr`, batches of `retrain_batch_size`) -> the new phi_re.

Server state: the FedAvg model, F [C, m, d], phi_re. Client state: none. Evaluated model:
(theta^{t+1}, phi_re). Communication: down Sigma + |phi_re|; up Sigma + (#own classes) |phi| + n_i.
`retrain=False` switches steps 1, 3 (features) and 4 off: exactly FedAvg (messages included).
The head must be one Linear layer (the re-trained classifier is a Linear); its gradients are
written out by hand (`linear_ce_gradients`), vectorised over classes.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from pydantic import Field

from pfedkit.algorithms.extra_layers import check_linear_head
from pfedkit.algorithms.registry import register
from pfedkit.core.aggregation import fedavg_aggregate
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, HyperParams, Message
from pfedkit.core.params import Params, clone, linear_layer_names, merge, select
from pfedkit.core.seeds import SERVER, torch_generator

FEATURE_CHUNK = 512  # samples per eval-mode forward when computing features (memory bound only)
COSINE_FLOOR = 1e-12  # cos = <a, b> / max(|a||b|, COSINE_FLOOR): rows of zeros give cos 0


# ---------------------------------------------------------------------------------------------
# The math (pure functions)


def linear_ce_gradients(features: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradient of mean CE(features @ W^T + b, labels) w.r.t. (W, b), batched over leading dims.

    features [..., B, d], labels [..., B] (or [B]), W [C, d], b [C]:
        G = (softmax(z) - onehot(y)) / B,   dW = G^T features [..., C, d],   db = sum_B G [..., C].
    Differentiable in `features` (used with autograd by the feature matching)."""
    logits = features @ weight.T
    if bias is not None:
        logits = logits + bias
    residual = torch.softmax(logits, dim=-1)
    residual = residual - torch.nn.functional.one_hot(labels, weight.shape[0]).to(residual.dtype)
    residual = residual / features.shape[-2]
    grad_weight = residual.transpose(-1, -2) @ features
    return grad_weight, (residual.sum(-2) if bias is not None else None)


def row_cosine_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum over rows r of (1 - <a_r, b_r> / max(|a_r| |b_r|, COSINE_FLOOR)), rows = the last axis
    (a 1-d tensor is one row); leading axes are summed too. Invariant to a_r -> s a_r, s > 0."""
    dot = (a * b).sum(-1)
    norms = (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(COSINE_FLOOR)
    return (1 - dot / norms).sum()


def matching_distance(synthetic: tuple[torch.Tensor, torch.Tensor | None],
                      real: tuple[torch.Tensor, torch.Tensor | None], match_bias: bool = True) -> torch.Tensor:
    """D(g_syn, g_real) = sum over the weight's output rows of (1 - cos) [+ (1 - cos) of the bias as
    one row when `match_bias`]; tensors may carry a leading class axis (summed)."""
    distance = row_cosine_distance(synthetic[0], real[0])
    if match_bias and synthetic[1] is not None:
        distance = distance + row_cosine_distance(synthetic[1], real[1])
    return distance


def class_gradients(features: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    *, batch_size: int, repeats: int, generator: torch.Generator
                    ) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
    """Client step 1: for each class c present in `labels`, the mean over `repeats` draws of
    linear_ce_gradients on min(batch_size, n_c) class-c samples drawn without replacement
    (a fresh permutation per draw; draws ordered repeat by repeat, classes ascending)."""
    classes = [int(c) for c in torch.unique(labels)]
    members = {c: torch.nonzero(labels == c).flatten() for c in classes}
    sums: dict[int, list[torch.Tensor | None]] = {c: [torch.zeros_like(weight), None if bias is None else
                                                      torch.zeros_like(bias)] for c in classes}
    for _ in range(repeats):
        for c in classes:
            pick = members[c][torch.randperm(len(members[c]), generator=generator)[:batch_size]]
            grad_w, grad_b = linear_ce_gradients(features[pick], labels[pick], weight, bias)
            sums[c][0] += grad_w
            if bias is not None:
                sums[c][1] += grad_b
    return {c: (w / repeats, None if b is None else b / repeats) for c, (w, b) in sums.items()}


def match_features(features: torch.Tensor, targets: dict[int, tuple[torch.Tensor, torch.Tensor | None]],
                   weight: torch.Tensor, bias: torch.Tensor | None, *, steps: int, lr: float,
                   match_bias: bool = True) -> tuple[torch.Tensor, list[float]]:
    """Step 3: `steps` plain SGD steps (lr) on F [C, m, d] minimising
    L(F) = sum_{c in targets} D(linear_ce_gradients(F_c, c | W, b), targets[c]) (phi = (W, b)
    fixed; classes without a target keep their features). Returns (new F, [L before each step,
    L after the last step])."""
    classes = sorted(targets)
    features = features.detach().clone()
    if not classes or steps == 0:
        return features, []
    index = torch.tensor(classes)
    labels = index[:, None].expand(len(classes), features.shape[1])
    real_w = torch.stack([targets[c][0] for c in classes])
    real_b = torch.stack([targets[c][1] for c in classes]) if bias is not None else None
    live = features[index].requires_grad_(True)
    losses = []
    for _ in range(steps + 1):
        synthetic = linear_ce_gradients(live, labels, weight.detach(), None if bias is None else bias.detach())
        loss = matching_distance(synthetic, (real_w, real_b), match_bias)
        losses.append(float(loss.detach()))
        if len(losses) > steps:
            break
        (grad,) = torch.autograd.grad(loss, [live])
        with torch.no_grad():
            live -= lr * grad
    features[index] = live.detach()
    return features, losses


def fresh_linear(in_features: int, out_features: int, generator: torch.Generator,
                 with_bias: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """PyTorch's default nn.Linear initialisation, from `generator`: W, b ~ U(-1/sqrt(d), 1/sqrt(d))."""
    bound = 1.0 / float(np.sqrt(in_features))
    weight = torch.empty(out_features, in_features).uniform_(-bound, bound, generator=generator)
    bias = torch.empty(out_features).uniform_(-bound, bound, generator=generator) if with_bias else None
    return weight, bias


def retrain_classifier(features: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       *, epochs: int, lr: float, batch_size: int, generator: torch.Generator
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Step 4: `epochs` epochs of plain SGD on mean CE(x W^T + b, y) over shuffled mini-batches of
    (features [n, d], labels [n]) (one permutation per epoch, last batch smaller), from (W, b).

    Fast form of the same updates: the bias is an extra weight column on a constant-1 input, each
    epoch's shuffled data is gathered once, and the step W <- W - (lr/B) (softmax(xW^T) - Y)^T x
    is written by hand (4 small ops, no autograd)."""
    n, dim = features.shape
    classes = weight.shape[0]
    with torch.no_grad():
        inputs = features.detach() if bias is None else torch.cat([features.detach(), torch.ones(n, 1)], 1)
        augmented = weight.detach().clone() if bias is None else torch.cat([weight.detach(), bias.detach()[:, None]], 1)
        targets = torch.nn.functional.one_hot(labels, classes).to(inputs.dtype)
        for _ in range(epochs):
            order = torch.randperm(n, generator=generator)
            xs, ys = inputs[order], targets[order]
            for start in range(0, n, batch_size):
                x, y = xs[start:start + batch_size], ys[start:start + batch_size]
                residual = torch.softmax(x @ augmented.T, dim=1).sub_(y)
                augmented.addmm_(residual.T, x, alpha=-lr / len(x))
    if bias is None:
        return augmented, None
    return augmented[:, :dim].contiguous(), augmented[:, dim].contiguous()


def mean_cross_entropy(features: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> float:
    """mean CE(features W^T + b, labels) (the re-trained classifier's loss on F, for the record)."""
    logits = features @ weight.T + (0 if bias is None else bias)
    return float(torch.nn.functional.cross_entropy(logits, labels))


# ---------------------------------------------------------------------------------------------
# The algorithm


@register
class CReFF(Algorithm):
    name = "creff"
    description = "CReFF: FedAvg + a classifier re-trained on server-side features learnt by gradient matching"
    evaluated_model = "custom"  # the FedAvg body with the server's re-trained classifier
    # the server's loops shortened (100 features per class, 100 matching steps, 300 re-training epochs)
    quick_test_options = {"num_features": 4, "feature_steps": 2, "retrain_epochs": 2, "grad_repeats": 1}
    head = "last"
    # The server's loops and the clients' gradient draws are thousands of tiny ops: one thread is
    # fastest. The engine runs this algorithm's own code (client updates between their Fits, the
    # aggregation) with it; local training keeps the run's count (`Algorithm.small_op_threads`).
    small_op_threads = 1

    class Hyper(HyperParams):
        """CReFF options (defaults: the CReFF-FL code's `options.py`, = the paper [paper][code: CReFF-FL]).

        retrain: re-train the classifier on federated features (False: plain FedAvg) [ours: switch].
        num_features: m, federated features per class (`num_of_feature` 100) [code].
        feature_steps / feature_lr: SGD steps and lr of the feature matching (`match_epoch` 100,
            `lr_feature` 0.1) [code]. Plain SGD, no momentum [code].
        retrain_epochs / retrain_lr / retrain_batch_size: re-training of the fresh Linear classifier
            (`crt_epoch` 300, `lr_net` 0.01, the local batch size 32) [code].
        grad_batch_size / grad_repeats: class-c samples per gradient draw and draws averaged
            (`batch_real` 32, 10 repeats hard-coded) [code].
        match_bias: count the bias gradient as one row of the matching distance [spec]; False drops
            it, as the dataset-condensation `distance_wb` in most CReFF-derived code does [code].
        Local training (epochs, batch, lr) is the run config's; CReFF's own 10 epochs / batch 32 /
        lr 0.1 are a preset matter.
        """
        retrain: bool = Field(True, description="re-train the classifier on federated features (False: FedAvg)")
        num_features: int = Field(100, ge=1, description="m: federated features per class")
        feature_steps: int = Field(100, ge=0, description="SGD steps of the gradient matching per round")
        feature_lr: float = Field(0.1, gt=0, description="SGD lr of the gradient matching")
        retrain_epochs: int = Field(300, ge=0, description="epochs of the classifier re-training per round")
        retrain_lr: float = Field(0.01, gt=0, description="SGD lr of the classifier re-training")
        retrain_batch_size: int = Field(32, ge=1, description="mini-batch of the classifier re-training")
        grad_batch_size: int = Field(32, ge=1, description="class-c samples per client gradient draw")
        grad_repeats: int = Field(10, ge=1, description="client gradient draws averaged per class")
        match_bias: bool = Field(True, description="include the bias (one row) in the matching distance")

    def check(self) -> None:
        check_linear_head(self.setup, self.name)

    # --- state ---------------------------------------------------------------------------------

    def init_server(self, params: Params) -> dict[str, Any]:
        server = {"params": clone(params)}
        if self.hyper.retrain:
            head = clone(select(params, "head"))
            weight_name, _ = linear_layer_names(head, "head")
            classes, dim = head[weight_name].shape
            generator = torch_generator(self.setup.seed, 0, SERVER, "creff-features")
            server["features"] = torch.randn(classes, self.hyper.num_features, dim, generator=generator)
            server["head_re"] = head
        return server

    # --- round ---------------------------------------------------------------------------------

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        if not self.hyper.retrain:
            return {cid: {"params": server["params"]} for cid in cids}
        return {cid: {"params": server["params"], "head_re": server["head_re"]} for cid in cids}

    def client_update(self, rnd: int, cid: int, client: Any, message: Message, data: ClientData) -> ClientUpdate:
        reply: Message = {}
        if self.hyper.retrain:
            reply["grads"] = self.client_gradients(rnd, cid, message, data)
        params = yield Fit(message["params"])  # from the FedAvg classifier phi, never phi_re
        return client, {"params": params, "weight": data.n_train, **reply}

    def client_gradients(self, rnd: int, cid: int, message: Message, data: ClientData) -> dict[int, Params]:
        """{c: g_{i,c} by head parameter name} for the classes the client owns (step 1)."""
        head_re = message["head_re"]
        weight_name, bias_name = linear_layer_names(head_re, "head")
        features = self.setup.ops_for(cid).features(message["params"], data.x_train, data.buffers,
                                                    chunk=FEATURE_CHUNK).reshape(data.n_train, -1)
        grads = class_gradients(features, data.y_train.long(), head_re[weight_name],
                                head_re[bias_name] if bias_name else None, batch_size=self.hyper.grad_batch_size,
                                repeats=self.hyper.grad_repeats,
                                generator=torch_generator(self.setup.seed, rnd, cid, "creff-grad"))
        return {c: {weight_name: w, **({bias_name: b} if bias_name else {})} for c, (w, b) in grads.items()}

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        if not replies:
            return server
        new = {**server, "params": fedavg_aggregate(replies)}
        if self.hyper.retrain:
            new.update(self.retrain_head(rnd, server, replies))
        return new

    def retrain_head(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        """Steps 3-4: match F to the mean class gradients at phi_re, then a fresh Linear on F."""
        head_re = server["head_re"]
        weight_name, bias_name = linear_layer_names(head_re, "head")
        weight, bias = head_re[weight_name], (head_re[bias_name] if bias_name else None)
        targets = mean_class_gradients(replies, weight_name, bias_name)
        classes, m, dim = server["features"].shape
        generator = torch_generator(self.setup.seed, rnd, SERVER, "creff-retrain")
        start_w, start_b = fresh_linear(dim, classes, generator, with_bias=bias_name is not None)
        labels = torch.arange(classes).repeat_interleave(m)
        features, losses = match_features(server["features"], targets, weight, bias, steps=self.hyper.feature_steps,
                                          lr=self.hyper.feature_lr, match_bias=self.hyper.match_bias)
        flat = features.reshape(classes * m, dim)
        new_w, new_b = retrain_classifier(flat, labels, start_w, start_b, epochs=self.hyper.retrain_epochs,
                                          lr=self.hyper.retrain_lr, batch_size=self.hyper.retrain_batch_size,
                                          generator=generator)
        if losses:
            self.record(rnd, "matching_loss_start", losses[0])
            self.record(rnd, "matching_loss", losses[-1])
        self.record(rnd, "retrain_loss", mean_cross_entropy(flat, labels, new_w, new_b))
        self.record(rnd, "matched_classes", len(targets))
        head = {weight_name: new_w, **({bias_name: new_b} if bias_name else {})}
        return {"features": features, "head_re": head}

    def client_model(self, cid: int, server: dict, client: Any) -> Params:
        """(theta^{t+1}, phi_re); with retrain=False the FedAvg model."""
        return merge(server["params"], server["head_re"]) if self.hyper.retrain else server["params"]


def mean_class_gradients(replies: dict[int, Message], weight_name: str, bias_name: str | None
                         ) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
    """g_bar_c = plain mean of g_{i,c} over the replies that carry class c [code: unweighted]."""
    collected: dict[int, list[Params]] = {}
    for cid in sorted(replies):
        for c, grad in replies[cid].get("grads", {}).items():
            collected.setdefault(int(c), []).append(grad)
    return {c: (torch.stack([g[weight_name] for g in grads]).mean(0),
                torch.stack([g[bias_name] for g in grads]).mean(0) if bias_name else None)
            for c, grads in sorted(collected.items())}
