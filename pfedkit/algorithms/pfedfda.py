"""pFedFDA (Mclaughlin, Su, *Personalized Federated Learning via Feature Distribution Adaptation*,
NeurIPS 2024).

The body f is trained as in FedAvg, but under a generative classifier: class-conditional Gaussians
N(mu_c, Sigma) on the features z = f(x) with one covariance shared by the classes. The Bayes rule of
those Gaussians with client i's class priors pi_i is the linear (LDA) head

    W_c = Sigma~^-1 mu_c,   b_c = -1/2 mu_c^T Sigma~^-1 mu_c + log pi_ic                           (1)
    Sigma~ = (1 - eps) Sigma + eps tr(Sigma)/d I            (shrinkage, eps = 1e-4)

A round of client i: (a) the head (1) of the received global statistics (mu^g, Sigma^g) is frozen
and the body trained on CE; (b) the local estimates from the trained body's features,

    mu^_c = mean of class c's features (n_ic > K; else mu^g_c)
    Sigma^ = S / (n_i - 1) + eps + I,  S the scatter about those means                              (2)

(c) the interpolation weights beta = (beta_mu, beta_Sigma) in [0, 1] minimising the K-fold
stratified cross-validated CE of the head (1) built from the interpolated fold estimates (L-BFGS
from 0.5, 10 iterations), and (d) the adaptive statistics

    mu_i = beta_mu mu^ + (1 - beta_mu) mu^g,   Sigma_i = beta_Sigma Sigma^ + (1 - beta_Sigma) Sigma^g    (3)

uploaded with the body. The server averages body, mu and Sigma with n_i weights (`MeanOfUploads`):
the global statistics are the n_i-weighted pool of the adaptive ones.

Evaluated: the client's body as it trained it with the head (1) of its adaptive statistics (3) and
its priors; a client that never trained: the global body and the global Gaussian classifier.
`evaluate_with=global_body` (the authors' evaluation): the global body with the head of statistics
and beta re-fitted under it on the client's training features at every evaluation.
Communication: body + C d + d^2 floats down; the same + n_i up. docs/algorithms/pfedfda.md.
"""
from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from pfedkit.algorithms.extra_layers import check_linear_head
from pfedkit.algorithms.registry import register
from pfedkit.core.aggregation import MeanOfUploads
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, HyperParams, Message
from pfedkit.core.params import Params, clone, linear_layer_names, merge, select
from pfedkit.core.seeds import SERVER, torch_generator

MEANS = "pfedfda.means"             # mu [C, d], averaged with the body
COVARIANCE = "pfedfda.covariance"   # Sigma [d, d], shared by the classes
FEATURE_CHUNK = 512                 # samples per forward when computing features (memory bound only)
BETA_START, BETA_ITERATIONS, BETA_GRADIENT_TOLERANCE = 0.5, 10, 1e-3  # the authors' L-BFGS settings


# ---------------------------------------------------------------------------------------------
# The math (pure functions)


def class_priors(counts: np.ndarray | torch.Tensor, eps: float) -> torch.Tensor:
    """pi_c = (n_c / n + eps) / sum(...): no class has prior 0 (its log is the head's bias)."""
    counts = torch.as_tensor(np.asarray(counts), dtype=torch.float32)
    priors = counts / counts.sum() + eps
    return priors / priors.sum()


def lda_classifier(means: torch.Tensor, covariance: torch.Tensor, priors: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(W [C, d], b [C]) of eq. (1), the Bayes rule of N(mu_c, Sigma~) with priors pi."""
    dim = covariance.shape[0]
    shrunk = (1.0 - eps) * covariance + eps * torch.trace(covariance) / dim * torch.eye(dim, dtype=covariance.dtype)
    weight = torch.linalg.solve(shrunk, means.T).T
    return weight, -0.5 * (means * weight).sum(dim=1) + priors.log()


def gaussian_estimates(features: torch.Tensor, labels: torch.Tensor, fallback_means: torch.Tensor,
                       min_samples: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mu^, Sigma^) of eq. (2): class means where a class has more than `min_samples` samples
    (the fallback, global mean otherwise) and the shared covariance about them."""
    counts = torch.bincount(labels, minlength=fallback_means.shape[0])
    sums = torch.zeros_like(fallback_means).index_add_(0, labels, features)
    own = (counts > min_samples)[:, None]
    means = torch.where(own, sums / counts.clamp(min=1)[:, None].to(sums.dtype), fallback_means)
    centred = features - means[labels]
    dim = features.shape[1]
    covariance = centred.T @ centred / max(len(features) - 1, 1) + eps + torch.eye(dim, dtype=features.dtype)
    return means, covariance


def interpolated(beta: torch.Tensor, local: tuple[torch.Tensor, torch.Tensor],
                 global_: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. (3): beta[0] weighs the local means, beta[1] the local covariance."""
    return (beta[0] * local[0] + (1.0 - beta[0]) * global_[0],
            beta[1] * local[1] + (1.0 - beta[1]) * global_[1])


def stratified_folds(labels: torch.Tensor, folds: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Held-out positions of each fold: per class, a seeded permutation of its samples dealt to the
    folds in turn; classes with fewer than `folds` samples are left out (they cannot be split)."""
    held_out: list[list[torch.Tensor]] = [[] for _ in range(folds)]
    for label in torch.unique(labels):
        members = torch.nonzero(labels == label).flatten()
        if len(members) < folds:
            continue
        members = members[torch.randperm(len(members), generator=generator)]
        for fold in range(folds):
            held_out[fold].append(members[fold::folds])
    return [torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long) for parts in held_out]


def cross_validation_loss(beta: torch.Tensor, splits: list[tuple[tuple, torch.Tensor, torch.Tensor]],
                          global_: tuple[torch.Tensor, torch.Tensor], priors: torch.Tensor, eps: float) -> torch.Tensor:
    """Sum over folds of the CE on the held-out features of the head (1) built from eq. (3) with
    the fold's training estimates; `beta` clipped to [0, 1]."""
    beta = beta.clamp(0.0, 1.0)
    total = torch.zeros(())
    for local, features, labels in splits:
        weight, bias = lda_classifier(*interpolated(beta, local, global_), priors, eps)
        total = total + F.cross_entropy(features @ weight.T + bias, labels)
    return total


def estimate_beta(features: torch.Tensor, labels: torch.Tensor, global_: tuple[torch.Tensor, torch.Tensor],
                  priors: torch.Tensor, *, folds: int, eps: float, single: bool,
                  generator: torch.Generator) -> torch.Tensor:
    """(beta_mu, beta_Sigma) by L-BFGS on `cross_validation_loss`; (0, 0), the global
    statistics, where no class has `folds` samples to split."""
    held_out = stratified_folds(labels, folds, generator)
    if any(len(positions) == 0 for positions in held_out):
        return torch.zeros(2)
    used = torch.cat(held_out)
    splits = []
    for positions in held_out:
        train = used[~torch.isin(used, positions)]
        local = gaussian_estimates(features[train], labels[train], global_[0], folds, eps)
        splits.append((local, features[positions], labels[positions]))
    beta = torch.full((1 if single else 2,), BETA_START, requires_grad=True)
    optimizer = torch.optim.LBFGS([beta], max_iter=BETA_ITERATIONS, tolerance_grad=BETA_GRADIENT_TOLERANCE,
                                  line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = cross_validation_loss(beta.expand(2), splits, global_, priors, eps)
        loss.backward()
        return loss
    optimizer.step(closure)
    return beta.detach().clamp(0.0, 1.0).expand(2).clone()


# ---------------------------------------------------------------------------------------------
# The algorithm


@register
class PFedFDA(MeanOfUploads, Algorithm):
    """The server averages body + mu + Sigma (`MeanOfUploads`, key "shared")."""
    name = "pfedfda"
    description = "pFedFDA: FedAvg body under a Gaussian (LDA) head; local Gaussians interpolated with the global ones"
    evaluated_model = "custom"  # own trained body + the LDA head of its adaptive statistics
    averaged = "shared"

    class Hyper(HyperParams):
        eps: float = Field(1e-4, ge=0, lt=1, description="covariance shrinkage and prior floor (the authors' 1e-4)")
        cv_folds: int = Field(2, ge=2, description="K: folds of the stratified cross-validation estimating beta; "
                              "a class needs more than K samples for its own mean")
        beta: Literal["two", "one"] = Field("two", description="one beta for the means and one for the covariance "
                                            "(the authors' default), or a single one for both")
        fixed_beta: float | None = Field(None, ge=0, le=1, description="use this beta instead of estimating it "
                                         "(0: the global Gaussians, 1: the local estimates)")
        evaluate_with: Literal["own_body", "global_body"] = Field(
            "own_body", description="own_body: the client's trained body with the head of the statistics it "
            "fitted in its round; global_body (the authors' evaluation): the global body, its statistics and "
            "beta re-fitted on the client's training features under that body at every evaluation")

    def check(self) -> None:
        check_linear_head(self.setup, self.name, needs_bias=True)

    def head_names(self) -> tuple[str, str]:
        head = {f"head.{n}": p for n, p in self.setup.ops.template.head.named_parameters()}
        weight, bias = linear_layer_names(head, "head")
        return weight, bias

    def lda_head(self, means: torch.Tensor, covariance: torch.Tensor, cid: int) -> Params:
        """The model's head set to eq. (1) with client cid's priors."""
        priors = class_priors(self.setup.train_counts[cid], self.hyper.eps)
        weight, bias = lda_classifier(means, covariance, priors, self.hyper.eps)
        weight_name, bias_name = self.head_names()
        return {weight_name: weight, bias_name: bias}

    def init_server(self, params: Params) -> dict[str, Any]:
        """The initial body; mu ~ U(0, 1) (seeded) and Sigma = I, as the authors'."""
        num_classes, dim = self.setup.num_classes, int(self.setup.ops.template.feature_dim)
        generator = torch_generator(self.setup.seed, 0, SERVER, "pfedfda-init")
        statistics = {MEANS: torch.rand(num_classes, dim, generator=generator), COVARIANCE: torch.eye(dim)}
        return {"shared": merge(clone(select(params, "body")), statistics)}

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        return {}  # until it trains: the global body and the global Gaussian classifier

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        return {cid: {"params": server["shared"]} for cid in cids}

    def beta(self, cid: int, features: torch.Tensor, labels: torch.Tensor,
             global_: tuple[torch.Tensor, torch.Tensor], generator: torch.Generator) -> torch.Tensor:
        if self.hyper.fixed_beta is not None:
            return torch.full((2,), float(self.hyper.fixed_beta))
        priors = class_priors(self.setup.train_counts[cid], self.hyper.eps)
        return estimate_beta(features, labels, global_, priors, folds=self.hyper.cv_folds, eps=self.hyper.eps,
                             single=self.hyper.beta == "one", generator=generator)

    def adapted_statistics(self, cid: int, body: Params, data: ClientData, global_: tuple[torch.Tensor, torch.Tensor],
                           generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Steps (b)-(d): (mu_i, Sigma_i, beta) of eq. (3) from the training features under `body`."""
        features = self.setup.ops_for(cid).features(body, data.x_train, data.buffers, chunk=FEATURE_CHUNK)
        features = features.reshape(data.n_train, -1)
        labels = data.y_train.long()
        local = gaussian_estimates(features, labels, global_[0], self.hyper.cv_folds, self.hyper.eps)
        beta = self.beta(cid, features, labels, global_, generator)
        return (*interpolated(beta, local, global_), beta)

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        shared = message["params"]
        global_ = (shared[MEANS], shared[COVARIANCE])
        trained = yield Fit(merge(select(shared, "body"), self.lda_head(*global_, cid)), trainable="body")
        body = select(trained, "body")
        folds = torch_generator(self.setup.seed, rnd, cid, "pfedfda-folds")
        means, covariance, beta = self.adapted_statistics(cid, body, data, global_, folds)
        state = {"body": body, "means": means, "covariance": covariance, "beta": beta}
        return state, {"params": merge(body, {MEANS: means, COVARIANCE: covariance}), "weight": data.n_train}

    def trained_model(self, cid: int, client: dict, params: Params) -> Params:
        """Right after training (`eval_point=after_local_training`): the trained body with the head
        of the adaptive statistics just fitted, not the frozen head of the global ones it trained under."""
        return merge(client["body"], self.lda_head(client["means"], client["covariance"], cid))

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        """Own body + the head of its adaptive statistics; before its first training the global ones.
        `evaluate_with=global_body`: the global body and head (`predict` uses the re-fitted head)."""
        if "body" in client and self.hyper.evaluate_with == "own_body":
            return merge(client["body"], self.lda_head(client["means"], client["covariance"], cid))
        shared = server["shared"]
        return merge(select(shared, "body"), self.lda_head(shared[MEANS], shared[COVARIANCE], cid))

    def has_custom_predict(self) -> bool:
        return self.hyper.evaluate_with == "global_body"

    def evaluation_state(self, cid: int, server: dict, client: dict, params: Params, data: ClientData) -> dict:
        """`global_body`: the head (1) of the statistics re-fitted under the evaluated body (the
        authors' evaluation; its folds seeded apart from training's, the same at every evaluation)."""
        if self.hyper.evaluate_with == "own_body":
            return client
        shared = server["shared"]
        folds = torch_generator(self.setup.seed, 0, cid, "pfedfda-evaluation-folds")
        means, covariance, _ = self.adapted_statistics(cid, select(params, "body"), data,
                                                       (shared[MEANS], shared[COVARIANCE]), folds)
        return {"head": self.lda_head(means, covariance, cid)}

    def predict(self, cid: int, server: dict, client: dict, features: torch.Tensor) -> torch.Tensor:
        """`global_body`: the re-fitted head on the evaluated body's features."""
        return self.setup.ops_for(cid).head_logits(client["head"], features)
