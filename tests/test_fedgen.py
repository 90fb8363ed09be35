"""FedGen: the generator (BatchNorm in train and eval mode) against torch modules, the diversity
loss and the label-weighted teacher loss by hand, one server round of Adam on the generator
against torch.optim.Adam, the client's regularised loss and its schedule by hand, FedAvg of the
models, and a short digits run (bytes)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import final_state, learned_run, num_parameters
from torch import nn

from pfedkit.algorithms.fedgen import (FedGen, decayed, diversity_loss, draw_noise, fedgen_loss, generate,
                                       label_weights, teacher_loss)
from pfedkit.core.contract import ClientData, Forward, Setup, cross_entropy
from pfedkit.core.model_ops import ModelOps
from pfedkit.core.params import weighted_mean
from pfedkit.core.seeds import SERVER, torch_generator
from pfedkit.models.base import BodyHeadModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_model() -> BodyHeadModel:
    return BodyHeadModel([("fc1", nn.Linear(3, 5)), ("relu", nn.ReLU()), ("fc", nn.Linear(5, 4))], "fc")


def tiny_algorithm(**hyper) -> FedGen:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ops = ModelOps(tiny_model)
    hyper = {"hidden_dim": 6, "noise_dim": 3, **hyper}
    return FedGen(FedGen.Hyper(**hyper), Setup(3, 4, np.ones((3, 4)), seed=5, local_epochs=1, ops=ops))


def module_generator(params: dict, stats: dict) -> nn.Sequential:
    """The same generator as torch modules: Linear -> BatchNorm1d -> ReLU -> Linear."""
    hidden, inputs = params["fc.weight"].shape
    module = nn.Sequential(nn.Linear(inputs, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                           nn.Linear(hidden, params["out.weight"].shape[0]))
    with torch.no_grad():
        module[0].weight.copy_(params["fc.weight"]), module[0].bias.copy_(params["fc.bias"])
        module[1].weight.copy_(params["bn.weight"]), module[1].bias.copy_(params["bn.bias"])
        module[1].running_mean.copy_(stats["running_mean"]), module[1].running_var.copy_(stats["running_var"])
        module[3].weight.copy_(params["out.weight"]), module[3].bias.copy_(params["out.bias"])
    return module


def test_generator_is_linear_batchnorm_relu_linear_in_train_and_eval_mode():
    algo = tiny_algorithm()
    server = algo.init_server(algo.setup.ops.initial_params())
    params, stats = server["generator"], {k: v + 0.3 for k, v in server["generator_stats"].items()}
    labels, noise = torch.tensor([0, 3, 3, 1, 2]), torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    module = module_generator(params, stats)
    inputs = torch.cat([noise, F.one_hot(labels, 4).float()], dim=1)
    features, new_stats = generate(params, stats, labels, noise, 4, training=True)
    torch.testing.assert_close(features, module.train()(inputs))
    torch.testing.assert_close(new_stats["running_mean"], module[1].running_mean)
    torch.testing.assert_close(new_stats["running_var"], module[1].running_var)
    features, same_stats = generate(params, new_stats, labels, noise, 4, training=False)
    torch.testing.assert_close(features, module.eval()(inputs))
    assert all(torch.equal(same_stats[k], new_stats[k]) for k in new_stats)


def test_diversity_loss_by_hand():
    noise = torch.tensor([[0.0, 1.0], [2.0, 1.0], [1.0, 3.0]])
    features = torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.0, 0.0], [4.0, 1.0, 2.0]])
    total = 0.0
    for a in range(3):
        for b in range(3):
            noise_distance = sum((x - y) ** 2 for x, y in zip(noise[a].tolist(), noise[b].tolist())) / 2
            feature_distance = sum(abs(x - y) for x, y in zip(features[a].tolist(), features[b].tolist())) / 3
            total += noise_distance * feature_distance
    assert float(diversity_loss(noise, features)) == pytest.approx(math.exp(-total / 9), rel=1e-6)


def test_teacher_loss_weighs_each_head_by_its_share_of_the_label():
    counts = torch.tensor([[6, 0, 1], [2, 5, 0]])  # two teachers, three labels
    weights = label_weights(counts)
    torch.testing.assert_close(weights, torch.tensor([[0.75, 0.0, 1.0], [0.25, 1.0, 0.0]]))
    g = torch.Generator().manual_seed(3)
    heads = [(torch.randn(3, 2, generator=g), torch.randn(3, generator=g)) for _ in range(2)]
    features, labels = torch.randn(4, 2, generator=g), torch.tensor([0, 1, 0, 2])
    expected = 0.0
    for k, (weight, bias) in enumerate(heads):
        ce = F.cross_entropy(features @ weight.T + bias, labels, reduction="none")
        expected += float((weights[k, labels] * ce).mean())
    assert float(teacher_loss(features, labels, heads, weights, "weighted_ce")) == pytest.approx(expected, rel=1e-6)
    mixed = sum(weights[k, labels].unsqueeze(1) * (features @ w.T + b) for k, (w, b) in enumerate(heads))
    assert float(teacher_loss(features, labels, heads, weights, "ensemble_ce")) == \
        pytest.approx(float(F.cross_entropy(mixed, labels)), rel=1e-6)


def reply(algo: FedGen, scale: float, counts: list[int], n: int) -> dict:
    params = {name: value * scale for name, value in algo.setup.ops.initial_params().items()}
    return {"params": params, "weight": n, "counts": torch.tensor(counts)}


def test_server_averages_the_models_and_trains_the_generator_with_adam_against_the_heads():
    algo = tiny_algorithm(generator_steps=2, generator_batch_size=4, generator_lr=0.01, generator_weight_decay=0.1,
                          eta=0.5, decay=0.9)
    server = algo.init_server(algo.setup.ops.initial_params())
    replies = {0: reply(algo, 1.0, [5, 0, 2, 1], 8), 2: reply(algo, -2.0, [0, 3, 1, 0], 4)}
    new = algo.aggregate(3, server, replies)
    expected = weighted_mean([replies[0]["params"], replies[2]["params"]], [8, 4])
    assert all(torch.equal(new["params"][n], expected[n]) for n in expected)

    # the same two steps with torch modules and torch.optim.Adam (lr 0.01 * 0.9^2 in round 3)
    module = module_generator(server["generator"], server["generator_stats"]).train()
    optimizer = torch.optim.Adam(module.parameters(), lr=0.01 * 0.9 ** 2, weight_decay=0.1)
    heads = [(r["params"]["head.fc.weight"], r["params"]["head.fc.bias"]) for r in (replies[0], replies[2])]
    weights = label_weights(torch.stack([replies[0]["counts"], replies[2]["counts"]]))
    qualified = torch.tensor([0, 1, 2])  # label 3: nobody has more than one sample
    rng = torch_generator(5, 3, SERVER, "fedgen")
    for _ in range(2):
        labels = qualified[torch.randint(3, (4,), generator=rng)]
        noise = draw_noise(4, 3, "gaussian", rng)
        features = module(torch.cat([noise, F.one_hot(labels, 4).float()], dim=1))
        optimizer.zero_grad()
        (teacher_loss(features, labels, heads, weights, "weighted_ce") + 0.5 * diversity_loss(noise, features)).backward()
        optimizer.step()
    reference = {"fc.weight": module[0].weight, "fc.bias": module[0].bias, "bn.weight": module[1].weight,
                 "bn.bias": module[1].bias, "out.weight": module[3].weight, "out.bias": module[3].bias}
    for name, value in reference.items():
        torch.testing.assert_close(new["generator"][name], value.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new["generator_stats"]["running_mean"], module[1].running_mean)
    assert new["adam"]["step"] == 2


def test_client_loss_adds_the_generated_ce_and_the_latent_kl_by_hand():
    g = torch.Generator().manual_seed(4)
    head = {"head.fc.weight": torch.randn(4, 5, generator=g), "head.fc.bias": torch.randn(4, generator=g)}
    context = {"sampled": torch.randn(6, 5, generator=g), "sampled_labels": torch.tensor([3, 0, 1, 1, 2, 0]),
               "same": torch.randn(6, 5, generator=g)}
    logits, y, index = torch.randn(3, 4, generator=g), torch.tensor([1, 2, 0]), torch.tensor([4, 0, 2])
    loss = fedgen_loss(Forward(torch.zeros(3, 5), logits, index), y, head, context, alpha=2.0, beta=0.5,
                       weight_name="head.fc.weight", bias_name="head.fc.bias")
    w, b = head["head.fc.weight"], head["head.fc.bias"]
    generated_ce = F.cross_entropy(context["sampled"][index] @ w.T + b, context["sampled_labels"][index])
    p = torch.softmax(context["same"][index] @ w.T + b, dim=1)
    kl = (p * (p.log() - torch.log_softmax(logits, dim=1))).sum(dim=1).mean()
    expected = F.cross_entropy(logits, y) + 2.0 * generated_ce + 0.5 * kl
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)


def client_data() -> ClientData:
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(5))
    y = torch.tensor([0, 2, 2, 0, 2, 0])
    return ClientData(1, x, y, x[:2], y[:2], np.array([3, 0, 3, 0]))


def test_round_one_is_cross_entropy_then_decayed_coefficients_and_generated_samples():
    algo, data = tiny_algorithm(alpha=4.0, beta=2.0, decay=0.5), client_data()
    server = algo.init_server(algo.setup.ops.initial_params())
    first = algo.broadcast(1, server, [1])[1]
    assert set(first) == {"params"} and next(algo.client_update(1, 1, None, first, data)).loss is cross_entropy
    message = algo.broadcast(3, server, [1])[1]
    request = next(algo.client_update(3, 1, None, message, data))
    assert request.loss.keywords["alpha"] == 1.0 and request.loss.keywords["beta"] == 0.5  # 4 * 0.5^2, 2 * 0.5^2
    assert decayed(1.0, 0.5, 30) == 1e-4  # never below 1e-4
    context = request.context
    assert context["sampled"].shape == (6, 5) and context["same"].shape == (6, 5)
    rng = torch_generator(5, 3, 1, "fedgen")
    labels = torch.arange(4)[torch.randint(4, (6,), generator=rng)]
    noise = draw_noise(12, 3, "gaussian", rng)
    assert torch.equal(context["sampled_labels"], labels)
    torch.testing.assert_close(context["same"], generate(server["generator"], server["generator_stats"], data.y_train,
                                                         noise[6:], 4, training=False)[0])
    own = tiny_algorithm(client_labels="own")
    labels = next(own.client_update(3, 1, None, message, data)).context["sampled_labels"]
    assert set(labels.tolist()) <= {0, 2}


def test_fedgen_learns_on_digits_and_sends_the_generator(small_config):
    config = {**small_config, "algorithm": "fedgen", "rounds": 3, "fedgen": {"generator_steps": 5}}
    result, metrics, state = learned_run(config)
    model = 4 * num_parameters(state.server["params"])
    generator = 4 * (num_parameters(state.server["generator"]) + num_parameters(state.server["generator_stats"]))
    assert (metrics[metrics["round"] == 1]["bytes_down"] == model).all()
    assert (metrics[metrics["round"] > 1]["bytes_down"] == model + generator).all()
    assert (metrics["bytes_up"] == model + 8 + 8 * 10).all()  # model, n_i, ten class counts
