"""FedCP: the conditional input, the policy network, the two heads and the RBF MMD against hand
computations; the loss (CE through a Gumbel-softmax policy over the pair + lam MMD to the received
body's features, read by sample position); what travels (body, CPN, a * own head + (1 - a) *
global head; the own head stays); the noise-free prediction; and the run on digits."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from conftest import TinyNet, learned_run, num_parameters, tiny_params

from pfedkit.algorithms.fedcp import (CPN, GLOBAL_HEAD, FedCP, conditional_input, fedcp_loss, initial_policy_network,
                                      policy_scores, rbf_mmd, separated_logits)
from pfedkit.core.contract import ClientData, Forward, Setup
from pfedkit.core.model_ops import ModelOps
from pfedkit.core.params import select

D, C = 4, 3  # TinyNet: 3 inputs -> 4 features -> 3 classes


def policy_params(seed: int = 0) -> dict:
    params = initial_policy_network(D, torch.Generator().manual_seed(seed))
    generator = torch.Generator().manual_seed(seed + 10)  # non-trivial LayerNorm affine parameters
    return {n: (v + 0.3 * torch.randn(v.shape, generator=generator) if ".norm." in n else v) for n, v in params.items()}


def random_head(prefix: str, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {f"{prefix}.weight": torch.randn(C, D, generator=generator), f"{prefix}.bias": torch.randn(C, generator=generator)}


def by_hand_scores(p: dict, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """ReLU(LN(W (h ⊙ c) + b)) as [B, 2, d]."""
    z = (h * c) @ p[f"{CPN}.linear.weight"].T + p[f"{CPN}.linear.bias"]
    mean, variance = z.mean(-1, keepdim=True), z.var(-1, unbiased=False, keepdim=True)
    z = (z - mean) / torch.sqrt(variance + 1e-5) * p[f"{CPN}.norm.weight"] + p[f"{CPN}.norm.bias"]
    return torch.relu(z).view(len(h), 2, D)


def by_hand_logits(h, policy, personal, global_head):
    """phi_i(h ⊙ s_P) + phi_G(h ⊙ s_G), the heads written out."""
    return ((h * policy[:, 0]) @ personal["head.weight"].T + personal["head.bias"]
            + (h * policy[:, 1]) @ global_head[f"{GLOBAL_HEAD}.weight"].T + global_head[f"{GLOBAL_HEAD}.bias"])


def by_hand_mmd(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    def k(a, b):
        return sum(np.exp(-float(((a - b) ** 2).sum()) / (2.0 * s)) for s in (10.0, 15.0, 20.0, 50.0))
    n = len(x)
    total = sum(k(x[i], x[j]) + k(y[i], y[j]) - 2.0 * k(x[i], y[j]) for i in range(n) for j in range(n))
    return torch.tensor(total / n ** 2, dtype=x.dtype)


def test_the_conditional_input_is_the_normalised_sum_of_the_head_rows():
    head = {"head.weight": torch.tensor([[1.0, 0.0, 2.0, 0.0], [2.0, 0.0, -2.0, 0.0], [0.0, 0.0, 0.0, -4.0]]),
            "head.bias": torch.zeros(3)}
    torch.testing.assert_close(conditional_input(head), torch.tensor([0.6, 0.0, 0.0, -0.8]))


def test_the_policy_scores_and_the_two_heads_against_hand_computations():
    p, generator = policy_params(), torch.Generator().manual_seed(1)
    h, c = torch.randn(5, D, generator=generator), torch.randn(D, generator=generator)
    scores = policy_scores(p, h, c)
    torch.testing.assert_close(scores, by_hand_scores(p, h, c))
    policy = torch.rand(5, 2, D, generator=generator)
    personal, global_head = random_head("head", 2), random_head(GLOBAL_HEAD, 3)
    torch.testing.assert_close(separated_logits(h, policy, personal, global_head),
                               by_hand_logits(h, policy, personal, global_head))


def test_the_rbf_mmd_is_the_biased_estimate_with_the_four_bandwidths():
    generator = torch.Generator().manual_seed(4)
    x, y = 3.0 * torch.randn(6, D, generator=generator), 3.0 * torch.randn(6, D, generator=generator) + 1.0
    torch.testing.assert_close(rbf_mmd(x, y), by_hand_mmd(x, y))
    assert abs(float(rbf_mmd(x, x))) < 1e-5


def test_the_loss_is_ce_through_a_gumbel_softmax_policy_plus_lam_mmd_to_the_reference_at_the_batch_positions():
    lam, y, index = 0.7, torch.tensor([0, 2, 1]), torch.tensor([4, 1, 5])
    generator = torch.Generator().manual_seed(5)
    p = {**policy_params(), **random_head("head", 6)}
    h = torch.randn(3, D, generator=generator)
    reference = torch.randn(6, D, generator=generator)  # f^0(x) of the client's 6 training samples
    condition, global_head = F.normalize(torch.randn(D, generator=generator), dim=0), random_head(GLOBAL_HEAD, 7)
    context = {**global_head, "condition": condition, "reference": reference}
    torch.manual_seed(11)
    loss = fedcp_loss(Forward(h, torch.zeros(3, C), index), y, p, context, lam=lam)

    torch.manual_seed(11)  # the same Gumbel(0, 1) draws, written out: softmax over the pair of (scores + g) / 1
    scores = by_hand_scores(p, h, condition)
    gumbel = -torch.empty_like(scores).exponential_().log()
    policy = torch.softmax(scores + gumbel, dim=1)
    task = F.cross_entropy(by_hand_logits(h, policy, p, global_head), y)
    torch.testing.assert_close(loss, task + lam * by_hand_mmd(h, reference[index]))


class TinyNetWithFeatureDim(TinyNet):
    feature_dim = D  # what the package's models declare; FedCP sizes its policy network by it


def algorithm(share: float = 0.3) -> FedCP:
    counts, ops = np.array([[3, 0, 1], [1, 1, 1]]), ModelOps(TinyNetWithFeatureDim)
    return FedCP(FedCP.Hyper(head_upload_share=share), Setup(2, C, counts, seed=0, local_epochs=1, ops=ops))


def shared_state(seed: int = 8) -> dict:
    return {**select(tiny_params(seed), "body"), **random_head(GLOBAL_HEAD, seed), **policy_params(seed)}


def test_body_cpn_and_the_mixed_global_head_travel_the_own_head_stays():
    share, algo, shared = 0.3, algorithm(0.3), shared_state()
    head = select(tiny_params(9), "head")
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(10))
    data = ClientData(0, x, torch.tensor([0, 0, 0, 2]), torch.zeros(1, 3), torch.zeros(1), np.array([3, 0, 1]))
    update = algo.client_update(1, 0, {"head": head}, {"params": shared}, data)
    request = next(update)
    assert set(request.extra) == {n for n in shared if n.startswith(CPN + ".")}
    assert set(request.params) == set(select(shared, "body")) | set(head)
    torch.testing.assert_close(request.context["condition"], conditional_input(head))
    for name in (f"{GLOBAL_HEAD}.weight", f"{GLOBAL_HEAD}.bias"):  # the global head: frozen, as context
        assert torch.equal(request.context[name], shared[name])
    body = torch.relu(x @ shared["body.0.weight"].T + shared["body.0.bias"])  # the received body's features
    torch.testing.assert_close(request.context["reference"], body)

    trained = {n: v + 1 for n, v in {**request.params, **request.extra}.items()}
    try:
        update.send(trained)
    except StopIteration as stop:
        state, reply = stop.value
    assert reply["weight"] == 4 and set(reply["params"]) == set(shared)
    for name in shared:
        if name.startswith(GLOBAL_HEAD):
            own = trained[name.replace(GLOBAL_HEAD, "head")]
            torch.testing.assert_close(reply["params"][name], share * own + (1 - share) * shared[name])
        else:
            assert torch.equal(reply["params"][name], trained[name])
    assert set(state) == {"head"} and torch.equal(state["head"]["head.weight"], head["head.weight"] + 1)


def test_the_prediction_uses_the_noise_free_policy_with_the_own_and_the_global_head():
    algo, shared = algorithm(), shared_state()
    head = select(tiny_params(12), "head")
    features = torch.randn(6, D, generator=torch.Generator().manual_seed(13))
    policy = torch.softmax(by_hand_scores(shared, features, conditional_input(head)), dim=1)
    torch.testing.assert_close(algo.predict(0, {"shared": shared}, {"head": head}, features),
                               by_hand_logits(features, policy, head, shared))


def test_the_server_starts_from_the_initial_head_as_global_head_and_a_seeded_policy_network():
    algo, params = algorithm(), tiny_params(14)
    first, second = algo.init_server(params)["shared"], algo.init_server(params)["shared"]
    assert torch.equal(first[f"{GLOBAL_HEAD}.weight"], params["head.weight"])
    assert not any(name.startswith("head.") for name in first)
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_fedcp_learns_on_digits_and_keeps_its_head(small_config):
    _, metrics, state = learned_run({**small_config, "algorithm": "fedcp", "join_ratio": 0.75})
    shared_bytes = 4 * num_parameters(state.server["shared"])
    joined = metrics[(metrics["round"] >= 1) & (metrics["participated"] == 1)]
    assert (joined["bytes_up"] == shared_bytes + 8).all() and (joined["bytes_down"] == shared_bytes).all()
    assert not any(name.startswith("head.") for name in state.server["shared"])
    assert all(set(client) == {"head"} for client in state.clients)
