"""FedPAC (Xu, Tong, Huang, *Personalized Federated Learning with Feature Alignment and Classifier
Collaboration*, ICLR 2023; baselines.md "FedPAC").

Client i, on receiving the global body f (and the combined head the server made for it last time,
else its own head):
  1. statistics with the received body, eval mode, on its training data (before training):
     pi_c = n_{i,c}/n_i, mu_c = class mean of f(x), h_{i,c} = pi_c mu_c and
     V_i = (1/n_i) sum_c [pi_c mean_{x in c} ||f(x)||^2 - pi_c^2 ||mu_c||^2]   (`feature_statistics`);
  2. `head_epochs` epochs on the head, body frozen (optimizer "head", lr `head_lr`);
  3. E epochs on the body, head frozen, loss CE + lam * MSE(f(x), c̄_y) (c̄: the global centroids
     of the previous round; samples of classes without one contribute 0; optimizer "body");
  4. uploads body, head, n_i, its class centroids after training (present classes, with counts),
     V_i and h_i ([C, d]).
Server: FedAvg of bodies (n_i); c̄_c = sum_i n_{i,c} mu_{i,c} / sum_i n_{i,c} over this round's
uploads; for every participant i the weights alpha_i = argmin over the simplex of
alpha^T (diag(V) + D_i) alpha with D_i[j,j'] = sum_c (h_{i,c} - h_{j,c})^T (h_{i,c} - h_{j',c})
(`solve_simplex_qp`; the matrix is rebuilt from its eigenvalues >= 0.01 if it is not PSD,
`project_psd`; weights < 1e-3 are zeroed and the rest renormalised; if the solve fails,
alpha_i = own head only). The combined head sum_j alpha_ij phi_j is kept per client and delivered at its next broadcast.

The QP is solved exactly by a non-negative least-squares reformulation (`solve_simplex_qp`):
with Q = L^T L, beta = argmin_{beta >= 0} ||L beta||^2 + (1^T beta - 1)^2 (scipy's Lawson-Hanson
active-set NNLS, finite) gives alpha = beta / 1^T beta, because NNLS's KKT conditions
(g = Q beta + (s-1) 1 >= 0, g ⊥ beta, s = 1^T beta > 0) are the simplex QP's KKT conditions for
alpha with multiplier (1-s)/s. The result is checked against those conditions before use.

The feature-alignment loss and the count-weighted centroid average are the shared prototype
helpers (`prototypes.alignment_loss`, `prototypes.global_prototypes(weighting="count")`), which
implement the same formulas. Paper-vs-code table: docs/algorithms/fedpac.md.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import scipy.optimize
import torch
from pydantic import Field

from pfedkit.algorithms.prototypes import alignment_loss, class_means, global_prototypes, present_class_means
from pfedkit.algorithms.registry import register
from pfedkit.core.aggregation import fedavg_aggregate
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, HyperParams, Message
from pfedkit.core.params import Params, clone, merge, select, weighted_mean
from pfedkit.core.search import float_range

FEATURE_CHUNK = 512      # samples per forward for the client's statistics (memory bound only)
PSD_EIGENVALUE_FLOOR = 0.01  # eigenvalues kept when the QP matrix must be projected to PSD
WEIGHT_FLOOR = 1e-3      # collaboration weights below this are zeroed, the rest renormalised
KKT_TOLERANCE = 1e-6     # relative to the QP matrix's largest diagonal entry
PSD_ROUNDING = 1e-10     # negative eigenvalues down to -this * max|diag| count as rounding zeros


# ---------------------------------------------------------------------------------------------
# The math (pure functions)


def feature_statistics(features: torch.Tensor, labels: torch.Tensor,
                       num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(V_i scalar, h_i [C, d]) from the client's body features (float64):

        pi_c = n_c / n,  mu_c = mean_{y=c} f(x),  h_c = pi_c mu_c,
        V_i  = (1/n) sum_c [pi_c mean_{y=c} ||f(x)||^2 - pi_c^2 ||mu_c||^2].

    Rows of absent classes are zero (pi_c = 0)."""
    features = features.double()
    n = max(int(labels.shape[0]), 1)
    means, counts = class_means(features, labels, num_classes)
    squared_norms, _ = class_means(features.pow(2).sum(dim=1, keepdim=True), labels, num_classes)
    priors = counts.double() / n
    weighted_means = priors[:, None] * means
    variance = (priors * squared_norms[:, 0] - priors.pow(2) * means.pow(2).sum(dim=1)).sum() / n
    return variance, weighted_means


def collaboration_matrix(index: int, variances: torch.Tensor, weighted_means: torch.Tensor) -> np.ndarray:
    """Q_i = diag(V) + D_i with D_i[j, j'] = sum_c (h_{i,c} - h_{j,c})^T (h_{i,c} - h_{j',c}).

    variances [m], weighted_means [m, C, d] over the participants; index = i's row. float64."""
    differences = (weighted_means[index].unsqueeze(0) - weighted_means).double().reshape(len(variances), -1)
    return (torch.diag(variances.double()) + differences @ differences.T).numpy()


def projected_eigenpairs(matrix: np.ndarray, floor: float = PSD_EIGENVALUE_FLOOR) -> tuple[np.ndarray, np.ndarray]:
    """(eigenvalues, eigenvectors as columns) of the symmetric part of a finite Q after the PSD
    projection: if Q is PSD, its own (rounding negatives set to 0); else those < floor dropped (0).

    "PSD" allows rounding noise: smallest eigenvalue >= -PSD_ROUNDING * (largest |diagonal entry|)
    [ours; a Gram matrix of dependent vectors has eigenvalues like -1e-17, which are zeros, not a
    reason to drop every eigenvalue below 0.01]."""
    symmetric = 0.5 * (matrix + matrix.T)
    eigenvalues, eigenvectors = np.linalg.eigh(symmetric)
    scale = float(np.abs(np.diag(symmetric)).max())
    if eigenvalues.min() >= -PSD_ROUNDING * scale:
        return np.clip(eigenvalues, 0.0, None), eigenvectors
    return np.where(eigenvalues >= floor, eigenvalues, 0.0), eigenvectors


def project_psd(matrix: np.ndarray, floor: float = PSD_EIGENVALUE_FLOOR) -> np.ndarray:
    """Q itself (symmetrised) if it is PSD, else rebuilt from its eigenpairs with eigenvalue >= floor."""
    eigenvalues, eigenvectors = projected_eigenpairs(np.asarray(matrix, dtype=np.float64), floor)
    return (eigenvectors * eigenvalues) @ eigenvectors.T


def simplex_kkt_residual(matrix: np.ndarray, alpha: np.ndarray) -> float:
    """How far alpha is from the KKT conditions of min_{alpha in simplex} alpha^T Q alpha:
    with g = Q alpha and lambda = alpha^T Q alpha, optimal iff alpha >= 0, sum alpha = 1,
    g_j >= lambda for all j and g_j = lambda where alpha_j > 0. Returns the largest violation."""
    gradient = matrix @ alpha
    level = float(alpha @ gradient)
    violations = [max(0.0, -float(alpha.min())), abs(float(alpha.sum()) - 1.0),
                  max(0.0, float((level - gradient).max())),
                  float(np.max(np.abs(alpha * (gradient - level))))]
    return max(violations)


def solve_simplex_qp(matrix: np.ndarray) -> np.ndarray | None:
    """argmin_{alpha >= 0, sum alpha = 1} alpha^T Q alpha, exactly, for Q after `project_psd`.

    With the projected eigenpairs Q = V diag(w) V^T, scaled by Q's largest diagonal entry (the
    minimiser does not change), L = diag(sqrt(w)) V^T gives Q = L^T L, and
    beta = argmin_{beta >= 0} ||[L; 1^T] beta - [0; 1]||^2 is solved by scipy's active-set NNLS;
    alpha = beta / sum(beta) (module docstring). Returns None (the caller keeps the own head) when
    Q is not finite, when the projected Q is 0 (every alpha is optimal: no preference [ours]) or
    when the result is not finite or fails the KKT check."""
    matrix = np.asarray(matrix, dtype=np.float64)
    size = matrix.shape[0]
    if size == 0 or not np.isfinite(matrix).all():
        return None
    eigenvalues, eigenvectors = projected_eigenpairs(matrix)
    projected = (eigenvectors * eigenvalues) @ eigenvectors.T
    scale = float(np.abs(np.diag(projected)).max())
    if scale <= 0:  # a PSD matrix with a zero diagonal is 0
        return None
    factor = np.sqrt(eigenvalues / scale)[:, None] * eigenvectors.T  # L, L^T L = Q / scale
    system = np.vstack([factor, np.ones((1, size))])
    target = np.zeros(size + 1)
    target[-1] = 1.0
    try:
        beta, _ = scipy.optimize.nnls(system, target)
    except (RuntimeError, ValueError):
        return None
    total = float(beta.sum())
    if not np.isfinite(total) or total <= 0:
        return None
    alpha = beta / total
    return alpha if simplex_kkt_residual(projected / scale, alpha) <= KKT_TOLERANCE else None


def sparsify_weights(alpha: np.ndarray, floor: float = WEIGHT_FLOOR) -> np.ndarray:
    """Weights below `floor` set to 0, the rest renormalised to sum 1."""
    kept = np.where(alpha < floor, 0.0, alpha)
    return kept / kept.sum()


def collaboration_weights(variances: torch.Tensor, weighted_means: torch.Tensor) -> np.ndarray:
    """[m, m]: row i = alpha_i over the m participants (own head only where the solve fails)."""
    size = len(variances)
    weights = np.zeros((size, size))
    for index in range(size):
        alpha = solve_simplex_qp(collaboration_matrix(index, variances, weighted_means))
        if alpha is None:
            weights[index, index] = 1.0
        else:
            weights[index] = sparsify_weights(alpha)
    return weights


# ---------------------------------------------------------------------------------------------
# The algorithm


@register
class FedPAC(Algorithm):
    name = "fedpac"
    description = "FedPAC: FedAvg body with feature alignment to global centroids, heads combined by a per-client QP"
    evaluated_model = "custom"  # global body + the head combined over peers by the QP's weights
    head = "last"
    head_splits = ("fc",)  # the QP combines whatever the head holds; the FedReMa paper's split is all FC layers

    class Hyper(HyperParams):
        lam: float = Field(1.0, ge=0, description="weight of the feature-alignment MSE to the global centroids",
                           json_schema_extra=float_range(0.1, 10.0, log=True))
        head_epochs: int = Field(1, ge=0, description="head epochs per round with the body frozen (0: none)")
        head_lr: float | None = Field(None, gt=0, description="learning rate of the head epochs "
                                      "(None: the config's lr; FL-bench uses 0.1)")

    def __init__(self, hyper: HyperParams, setup) -> None:
        super().__init__(hyper, setup)
        self.feature_dim = int(setup.ops.template.feature_dim)

    def init_server(self, params: Params) -> dict[str, Any]:
        """Global body, the combined head waiting for each client, global centroids (none yet)."""
        return {"body": clone(select(params, "body")), "heads": {}, "centroids": None}

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        return {"head": clone(select(params, "head"))}

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        messages = {}
        for cid in cids:
            message = {"body": server["body"]}
            if cid in server["heads"]:
                message["head"] = server["heads"][cid]
            if server["centroids"] is not None:
                message["centroids"] = server["centroids"]
            messages[cid] = message
        return messages

    def features(self, params: Params, data: ClientData) -> torch.Tensor:
        """Body outputs of the training data, eval mode, with the client's BatchNorm statistics."""
        features = self.setup.ops.features(params, data.x_train, data.buffers, chunk=FEATURE_CHUNK)
        return features.reshape(data.n_train, -1)

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        params = merge(message["body"], message.get("head", client["head"]))
        variance, weighted_means = feature_statistics(self.features(params, data), data.y_train, self.setup.num_classes)
        if self.hyper.head_epochs > 0:
            params = yield Fit(params, trainable="head", epochs=self.hyper.head_epochs, lr=self.hyper.head_lr, optimizer="head")
        centroids = message.get("centroids")
        params = yield Fit(params, loss=partial(alignment_loss, lambda_f=self.hyper.lam), trainable="body",
                           context={} if centroids is None else {"prototypes": centroids}, optimizer="body")
        classes, means, counts = present_class_means(self.features(params, data), data.y_train, self.setup.num_classes)
        reply = {"body": select(params, "body"), "head": select(params, "head"), "weight": data.n_train,
                 "prototypes": means.float(), "prototype_classes": classes, "prototype_counts": counts,
                 "variance": variance.float(), "weighted_means": weighted_means.float()}
        return {"head": select(params, "head")}, reply

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        if not replies:
            return server
        ordered = sorted(replies)
        centroids = global_prototypes([replies[c] for c in ordered], self.setup.num_classes, self.feature_dim,
                                      weighting="count")
        weights = collaboration_weights(torch.stack([replies[c]["variance"] for c in ordered]),
                                        torch.stack([replies[c]["weighted_means"] for c in ordered]))
        uploaded_heads = [replies[c]["head"] for c in ordered]
        heads = dict(server["heads"])
        for row, cid in enumerate(ordered):
            heads[cid] = weighted_mean(uploaded_heads, weights[row])
        matrix = np.full((self.setup.num_clients, self.setup.num_clients), np.nan)
        matrix[np.ix_(ordered, range(self.setup.num_clients))] = 0.0
        matrix[np.ix_(ordered, ordered)] = weights
        self.record(rnd, "fedpac_weights", matrix)
        return {"body": fedavg_aggregate(replies, key="body"), "heads": heads, "centroids": centroids}

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        """Global body + the combined head the client gets at its next download (own head before)."""
        return merge(server["body"], server["heads"].get(cid, client["head"]))
