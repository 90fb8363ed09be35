"""FedEM (Marfoq, Neglia, Bellet, Kameni, Vidal, NeurIPS 2021): federated multi-task learning
under a mixture of distributions.

Each client i's data is assumed drawn from a mixture of K shared distributions with client weights
pi_i (the client's state, initially uniform). A round, per participant i:

    E-step:  q_ik(s) = pi_ik exp(-l(h_k(x_s), y_s)) / sum_k' pi_ik' exp(-l(h_k'(x_s), y_s))     (E)
    M-step:  pi_ik = (1/n_i) sum_s q_ik(s)                                                     (M-pi)
             component k: E epochs of SGD from the server's theta_k on
                 (1/B) sum_{s in batch} q_ik(s) l(h_k(x_s), y_s)                                (M-theta)
    server:  theta_k = sum_i n_i theta_ik / sum_i n_i  (over the round's participants)        (agg)

    predict: p_i(y | x) = sum_k pi_ik softmax(h_k(x))_y                                        (P)

Client state: pi_i [K]. Communication per participant: K models down, K models + n_i up.
Evaluated: the mixture (P) through the contract's input-level hook `predict_inputs`; a client that
never trained fits pi by EM with the components fixed (`joining_state`). docs/algorithms/fedem.md.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field

from pfedkit.algorithms.clusters import seeded_models
from pfedkit.algorithms.registry import register
from pfedkit.algorithms.scoring import sample_losses
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, Forward, HyperParams, Message
from pfedkit.core.params import Params, weighted_mean
from pfedkit.core.search import int_range

INIT_PURPOSE = "fedem-init"
# EM iterations of a newcomer's pi with the components fixed (its losses computed once) [ours]
NEW_CLIENT_EM_STEPS = 100


# ---------------------------------------------------------------------------------------------
# Pure math
# ---------------------------------------------------------------------------------------------

def responsibilities(losses: torch.Tensor, pi: torch.Tensor) -> torch.Tensor:
    """(E): q [K, n], q[k, s] = pi_k exp(-losses[k, s]) / sum_k' pi_k' exp(-losses[k', s]),
    computed as a softmax over k of log pi_k - loss (no underflow for large losses; float64)."""
    losses = torch.as_tensor(losses, dtype=torch.float64)
    pi = torch.as_tensor(pi, dtype=torch.float64)
    if losses.dim() != 2 or losses.shape[0] != pi.numel():
        raise ValueError(f"responsibilities: losses must be [K={pi.numel()}, n], got {tuple(losses.shape)}")
    return torch.softmax(torch.log(pi)[:, None] - losses, dim=0)


def mixture_weights(q: torch.Tensor) -> torch.Tensor:
    """(M-pi): pi_k = mean over the client's samples of q[k, s] (a distribution over k)."""
    return q.mean(dim=1)


def responsibility_weighted_loss(out: Forward, y: torch.Tensor, params: Params,
                                 context: Mapping[str, Any]) -> torch.Tensor:
    """(M-theta): (1/B) sum_b q(s_b) CE(h(x_b), y_b), q = context["responsibility"] [n] read at the
    batch's positions in the client's training set."""
    weights = context["responsibility"][out.index]
    return (weights * F.cross_entropy(out.logits, y, reduction="none")).mean()


def mixture_log_probs(component_logits: list[torch.Tensor], pi: torch.Tensor) -> torch.Tensor:
    """log sum_k pi_k softmax(z_k) [B, C]: the mixture's log-probabilities, usable as logits (their
    softmax is the mixture, their cross-entropy its negative log-likelihood)."""
    log_pi = torch.log(torch.as_tensor(pi, dtype=component_logits[0].dtype))
    stacked = torch.stack([F.log_softmax(z, dim=1) for z in component_logits])  # [K, B, C]
    return torch.logsumexp(stacked + log_pi[:, None, None], dim=0)


# ---------------------------------------------------------------------------------------------
# The algorithm
# ---------------------------------------------------------------------------------------------

@register
class FedEM(Algorithm):
    name = "fedem"
    description = "FedEM: K shared component models, per-client mixture weights learned by federated EM"
    evaluated_model = "custom"  # the mixture (P) of the aggregated components with the client's pi
    quick_test_options = {"num_components": 2}

    class Hyper(HyperParams):
        """FedEM hyperparameters.

        num_components: K, the number of shared components (3 [paper, every experiment]).
        """
        num_components: int = Field(3, ge=1, description="K: number of shared component models",
                                    json_schema_extra=int_range(2, 5))

    def init_server(self, params: Params) -> dict[str, Any]:
        # component 0 is the run's initial model (so K = 1 is FedAvg), the others re-initialised [ours]
        return {"components": seeded_models(self.setup.ops.build, params, self.hyper.num_components,
                                            self.setup.seed, INIT_PURPOSE)}

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        k = self.hyper.num_components
        return {"pi": torch.full((k,), 1.0 / k, dtype=torch.float64)}

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        return {cid: {"components": server["components"]} for cid in cids}

    def component_losses(self, cid: int, components: list[Params], data: ClientData) -> torch.Tensor:
        """[K, n] cross-entropy of each training sample under each component, in eval mode with the
        client's own buffers (float64)."""
        ops = self.setup.ops_for(cid)
        return torch.stack([sample_losses(ops, c, data.x_train, data.y_train, data.buffers) for c in components])

    def e_step(self, cid: int, components: list[Params], pi: torch.Tensor, data: ClientData) -> torch.Tensor:
        """(E) over the client's training samples."""
        return responsibilities(self.component_losses(cid, components, data), pi)

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        components = message["components"]
        q = self.e_step(cid, components, client["pi"], data)
        trained = []
        for k, component in enumerate(components):
            context = {"responsibility": q[k].float()}
            # one optimizer slot per component (keep_optimizer_state); component 0 uses FedAvg's
            slot = "default" if k == 0 else f"component-{k}"
            trained.append((yield Fit(component, loss=responsibility_weighted_loss, context=context, optimizer=slot)))
        return {"pi": mixture_weights(q)}, {"components": trained, "weight": data.n_train}

    def aggregate(self, rnd: int, server: dict, replies: dict[int, Message]) -> dict[str, Any]:
        """(agg): each component the n_i-weighted mean of its uploads."""
        if not replies:
            return server
        ordered = sorted(replies)
        sizes = [replies[c]["weight"] for c in ordered]
        return {"components": [weighted_mean([replies[c]["components"][k] for c in ordered], sizes)
                               for k in range(self.hyper.num_components)]}

    def predict_inputs(self, cid: int, server: dict, client: dict, x: torch.Tensor,
                       buffers: Params | None = None) -> torch.Tensor:
        """(P): the mixture's log-probabilities on inputs x (the evaluated model)."""
        ops = self.setup.ops_for(cid)
        return mixture_log_probs([ops.logits(c, x, buffers) for c in server["components"]], client["pi"])

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        """The component of largest pi_ik: the parameter set the engine records and measures row
        norms of; predictions come from the whole mixture (`predict_inputs`)."""
        return server["components"][int(torch.argmax(client["pi"]))]

    def joining_state(self, cid: int, server: dict, client: dict, data: ClientData) -> dict[str, Any]:
        """A newcomer's pi, fitted by EM with the server's components fixed [paper, Sec. on unseen
        clients]: (E) and (M-pi) repeated NEW_CLIENT_EM_STEPS times from its uniform pi on its
        training data (the losses computed once)."""
        losses = self.component_losses(cid, server["components"], data)
        if losses.shape[1] == 0:
            return client  # no training sample: the uniform prior
        pi = client["pi"]
        for _ in range(NEW_CLIENT_EM_STEPS):
            pi = mixture_weights(responsibilities(losses, pi))
        return {**client, "pi": pi}
