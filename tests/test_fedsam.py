"""FedSAM: the SAM and ASAM perturbations and the first local step against hand computations on a
tiny model, rho = 0 is FedAvg's plain SGD, and the config's momentum not applying to the custom step."""
from __future__ import annotations

import pandas as pd
import torch
from conftest import TinyNet, final_state, tiny_params
from torch import nn
from torch.func import functional_call

import pfedkit
from pfedkit.algorithms.fedsam import FedSAM, asam_perturbation, sam_perturbation
from pfedkit.core.seeds import torch_generator
from pfedkit.engine.trainer import FitJob, LocalTrainer, TrainSettings, batch_schedule

COLUMNS = ["round", "client", "accuracy", "loss", "train_loss", "bytes_up", "bytes_down"]
CONFIG = {"dataset": "digits", "num_clients": 4, "rounds": 3, "threads": 1, "batch_size": 20, "lr": 0.05,
          "seed": 3, "partition": {"scheme": "dirichlet", "alpha": 0.5}}


def data(n: int):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, generator=g), torch.randint(0, 3, (n,), generator=g)


def grad_at(params, x, y):
    """grad of the mean cross-entropy of TinyNet at `params` on (x, y)."""
    point = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    loss = nn.functional.cross_entropy(functional_call(TinyNet(), point, (x,)), y)
    return dict(zip(point, torch.autograd.grad(loss, list(point.values()))))


def train(fit, settings, x, y):
    """Run a Fit request on TinyNet; also return the batch schedule the trainer used."""
    trainer = LocalTrainer(TinyNet, settings)
    schedule = batch_schedule(fit, settings, len(y), torch_generator(settings.seed, 1, 0, "fit-0"))
    return trainer.fit(FitJob(1, 0, 0, fit, None), x, y).params, schedule


def norm(params) -> float:
    return float(torch.sqrt(sum((v.double() ** 2).sum() for v in params.values())))


def test_sam_perturbation_is_rho_along_the_gradient():
    grad = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([[4.0]])}  # ||g|| = 5
    eps = sam_perturbation(grad, rho=0.5)
    torch.testing.assert_close(eps["a"], torch.tensor([0.3, 0.0]))
    torch.testing.assert_close(eps["b"], torch.tensor([[0.4]]))
    assert abs(norm(eps) - 0.5) < 1e-7
    assert norm(sam_perturbation({"a": torch.zeros(3)}, rho=0.5)) == 0.0  # a zero gradient: no 0 / 0


def test_asam_perturbation_scales_weights_by_their_magnitude_plus_eta():
    params = {"fc.weight": torch.tensor([2.0, -1.0]), "fc.bias": torch.tensor([5.0])}
    grad = {"fc.weight": torch.tensor([1.0, 1.0]), "fc.bias": torch.tensor([2.0])}
    eta, rho = 0.5, 0.3
    # T = (|w| + eta) on the weight: (2.5, 1.5); 1 on the bias. T g = (2.5, 1.5, 2); ||T g||^2 = 6.25 + 2.25 + 4
    scale = rho / 12.5 ** 0.5
    eps = asam_perturbation(grad, params, rho, eta)
    torch.testing.assert_close(eps["fc.weight"], torch.tensor([2.5 ** 2, 1.5 ** 2]) * scale)
    torch.testing.assert_close(eps["fc.bias"], torch.tensor([2.0]) * scale)


def first_step(variant: str, rho: float, lr: float = 0.2):
    """One SAM step of FedSAM's Fit on TinyNet (one full batch) and the same step by hand."""
    settings = TrainSettings(local_epochs=1, batch_size=12, lr=lr, seed=5)
    x, y = data(12)
    w = tiny_params()
    fit = FedSAM(FedSAM.Hyper(rho=rho, variant=variant, eta=0.1), None).local_fit({"params": w})
    out, (batch,) = train(fit, settings, x, y)
    g = grad_at(w, x[batch], y[batch])
    eps = sam_perturbation(g, rho) if variant == "sam" else asam_perturbation(g, w, rho, 0.1)
    sharp = grad_at({k: w[k] + eps[k] for k in w}, x[batch], y[batch])
    return out, {k: w[k] - lr * sharp[k] for k in w}, {k: w[k] - lr * g[k] for k in w}


def test_the_first_sam_step_takes_the_gradient_at_the_perturbed_point_and_applies_it_at_w():
    for variant in ("sam", "asam"):
        out, by_hand, plain = first_step(variant, rho=0.5)
        for k in by_hand:
            torch.testing.assert_close(out[k], by_hand[k])
        assert max(float((by_hand[k] - plain[k]).abs().max()) for k in plain) > 1e-4  # the perturbation matters


def test_rho_zero_gives_fedavg_bit_for_bit_and_the_config_momentum_does_not_apply(tmp_path):
    fedavg = pfedkit.run({**CONFIG, "algorithm": "fedavg", "out_dir": str(tmp_path / "fedavg")})
    flat = pfedkit.run({**CONFIG, "algorithm": "fedsam", "fedsam": {"rho": 0.0}, "momentum": 0.9,
                        "out_dir": str(tmp_path / "zero")})
    pd.testing.assert_frame_equal(flat.metrics[COLUMNS], fedavg.metrics[COLUMNS])
    fedavg_params, flat_params = final_state(fedavg).server["params"], final_state(flat).server["params"]
    assert all(torch.equal(flat_params[k], fedavg_params[k]) for k in fedavg_params)
    sam = pfedkit.run({**CONFIG, "algorithm": "fedsam", "out_dir": str(tmp_path / "sam")})
    assert sam.metrics[sam.metrics["round"] == CONFIG["rounds"]]["accuracy"].mean() > 0.3
    assert not sam.metrics["accuracy"].equals(fedavg.metrics["accuracy"])
