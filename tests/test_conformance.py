"""benchmarks/conformance: the export to PFLlib's format, the option mapping, the log parser, the rows."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from conftest import SHARED_DATASETS, needs_dataset

CONFORMANCE = Path(__file__).resolve().parent.parent / "benchmarks" / "conformance"
sys.path.insert(0, str(CONFORMANCE))

import curves  # noqa: E402
import mapping  # noqa: E402
import pfllib_data  # noqa: E402
import pfllib_run  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_partition(overrides: list[str]):
    from pfedkit.federation import resolve_partition

    return resolve_partition(overrides)


# --- the export ---------------------------------------------------------------------------------

def test_export_reads_back_the_same_rows_and_labels_in_the_partition_order(tmp_path):
    config, dataset, train_index, test_index = tiny_partition(
        ["dataset=digits", "num_clients=3", "partition.scheme=dirichlet", "partition.alpha=0.5", "seed=4"])
    out = pfllib_data.export_to_pfllib(tmp_path / "digits", dataset, train_index, test_index, config.to_dict())
    clients = pfllib_data.read_back(out, 3)
    for cid, client in enumerate(clients):
        np.testing.assert_array_equal(client.train_x, dataset.rows(train_index[cid]))
        np.testing.assert_array_equal(client.test_x, dataset.rows(test_index[cid]))
        np.testing.assert_array_equal(client.train_y, dataset.y[train_index[cid]])
        np.testing.assert_array_equal(client.test_y, dataset.y[test_index[cid]])
        assert client.train_x.dtype == np.float32 and client.train_y.dtype == np.int64
    indices = np.load(out / pfllib_data.INDICES)
    np.testing.assert_array_equal(indices["test_2"], test_index[2])


def test_export_files_load_the_way_pfllib_reads_them(tmp_path):
    """PFLlib: np.load(f, allow_pickle=True)['data'].tolist() -> {'x', 'y'}; torch.Tensor(x) as is."""
    x, y = np.random.default_rng(0).random((5, 1, 28, 28), dtype=np.float32), np.arange(5)
    pfllib_data.write_pfllib_npz(tmp_path / "train" / "0.npz", x, y)
    with open(tmp_path / "train" / "0.npz", "rb") as handle:
        data = np.load(handle, allow_pickle=True)["data"].tolist()
    assert set(data) == {"x", "y"}
    np.testing.assert_array_equal(data["x"], x)
    assert data["y"].dtype == np.int64


@needs_dataset("mnist")
def test_export_of_mnist_holds_the_stored_pixels_normalised_to_minus_one_one(tmp_path):
    config, dataset, train_index, test_index = tiny_partition(
        [str(mapping.SPLITS["mnist_fedrema"].config), "num_clients=5", "partition.samples_per_client=20",
         f"data_dir={SHARED_DATASETS}"])
    out = pfllib_data.export_to_pfllib(tmp_path / "mnist", dataset, train_index, test_index, config.to_dict())
    clients = pfllib_data.read_back(out, 5)
    for cid, client in enumerate(clients):
        pixels = np.rint((client.train_x[:, 0] * 0.5 + 0.5) * 255).astype(np.uint8)
        np.testing.assert_array_equal(pixels, dataset.stored[train_index[cid]])
        assert client.test_x.min() >= -1.0 and client.test_x.max() <= 1.0
        np.testing.assert_array_equal(client.test_y, dataset.y[test_index[cid]])
    assert [len(c.train_y) for c in clients] == [16] * 5  # the split's 4:1 of 20


def test_export_refuses_a_folder_with_files(tmp_path):
    (tmp_path / "old.txt").write_text("x")
    with pytest.raises(SystemExit, match="not empty"):
        pfllib_data.export_to_pfllib(tmp_path, None, [], [], {})


# --- the option mapping -------------------------------------------------------------------------

# Methods I and II (issues 45, 46): label -> (pfedkit algorithm, PFLlib -algo). Their pfedkit files land
# at different times: an entry whose algorithm is not registered yet is skipped by the option test
# below, and this list is what keeps the skip from hiding a misspelt name.
METHODS_I_II = {
    "FedNTD": ("fedntd", "FedNTD"), "FedLC": ("fedlc", "FedLC"), "FedBN": ("fedbn", "FedBN"),
    "SCAFFOLD": ("scaffold", "SCAFFOLD"), "FedDyn": ("feddyn", "FedDyn"), "FedALA": ("fedala", "FedALA"),
    "FedCP": ("fedcp", "FedCP"), "GPFL": ("gpfl", "GPFL"), "FedDBE": ("feddbe", "FedDBE"),
    "FedCAC": ("fedcac", "FedCAC"), "FedAS": ("fedas", "FedAS"), "FedPHP": ("fedphp", "FedPHP"),
    "APPLE": ("apple", "APPLE"), "FML": ("fml", "FML"), "FedKD": ("fedkd", "FedKD"), "FedPCL": ("fedpcl", "FedPCL"), "FedGen": ("fedgen", "FedGen"),
}
NOT_MAPPED_YET: set[str] = set()  # PFLlib methods pfedkit has not written yet (none now)
# the method flags that main.py parses at d832e76 (system/main.py:446-499)
PFLLIB_METHOD_FLAGS = {"-bt", "-lam", "-mu", "-K", "-lrp", "-M", "-itk", "-alk", "-sg", "-al", "-pls", "-tau", "-fte",
                       "-dlr", "-L", "-nd", "-glr", "-hd", "-se", "-lf", "-slr", "-et", "-s", "-p", "-mlr", "-Ts",
                       "-Te", "-mo", "-klw", "-fsb", "-ca", "-cmss"}


def registered(algorithm: str) -> bool:
    from pfedkit.catalog import catalog

    return algorithm in catalog().algorithms


@pytest.mark.parametrize("label", sorted(mapping.METHODS))
def test_every_pfedkit_option_a_method_maps_exists_and_is_what_the_run_resolves_to(label):
    method, split = mapping.METHODS[label], mapping.SPLITS["mnist_fedrema"]
    if label in METHODS_I_II and not registered(method.pfedkit):
        pytest.skip(f"{method.pfedkit} is not in this checkout yet (Methods I/II)")
    config = mapping.pfedkit_config(method, split).to_dict()
    assert config["algorithm"] == method.pfedkit
    split_values = mapping.read_split_config(split)
    for key, value in method.pfedkit_options.items():
        assert mapping.dotted(config, key) == mapping.resolve_placeholder(value, split_values)


def test_methods_i_and_ii_are_the_expected_set_with_their_names_and_options_in_their_own_section():
    """What the option test cannot check for a method not registered yet: its label, its pfedkit
    algorithm and PFLlib -algo (the expected names), each option in the method's own section or a
    top-level Config field, each PFLlib flag one that main.py parses."""
    from pfedkit.config import Config

    added = {m.label: (m.pfedkit, m.pfllib) for m in mapping.METHODS_I_II}
    assert added == METHODS_I_II
    assert set(mapping.NOT_MAPPED_YET) == NOT_MAPPED_YET and not NOT_MAPPED_YET & set(mapping.METHODS)
    assert all(mapping.METHODS[label] is m for label, m in zip(added, mapping.METHODS_I_II))
    for method in mapping.METHODS_I_II:
        for key in method.pfedkit_options:
            section = key.split(".")[0]
            assert (section == method.pfedkit) if "." in key else (key in Config.model_fields), (method.label, key)
        assert set(method.pfllib_flags) <= PFLLIB_METHOD_FLAGS, method.label
        assert method.pfllib_evaluation in ("first", "last") and method.departures, method.label


def test_every_shared_protocol_setting_names_a_pfedkit_key_with_the_value_stated():
    for split in mapping.SPLITS.values():
        config = mapping.pfedkit_config(mapping.METHODS["FedAvg"], split).to_dict()
        for setting in mapping.PROTOCOL:
            resolved = mapping.dotted(config, setting.pfedkit_key)
            if setting.pfedkit_value is not None:
                assert resolved == setting.pfedkit_value, setting.pfedkit_key


def test_a_misspelt_pfedkit_option_in_the_mapping_is_refused():
    from pfedkit.core.errors import ConfigError

    misspelt = mapping.Method("FedProx", "fedprox", "FedProx", {"fedprox.nu": 1.0})
    with pytest.raises(ConfigError, match="nu"):
        mapping.pfedkit_config(misspelt, mapping.SPLITS["mnist_fedrema"])


def test_per_fedavg_maps_pfllib_beta_equal_lr_and_two_trainings_a_round():
    split = mapping.SPLITS["mnist_fedrema"]
    config = mapping.pfedkit_config(mapping.METHODS["Per-FedAvg"], split)
    assert config.to_dict()["perfedavg"]["beta"] == 0.01 == config.lr
    assert config.local_epochs == 10


def test_pfllib_arguments_carry_the_split_settings_and_the_method_flags():
    split = mapping.SPLITS["mnist_fedrema"]
    arguments = mapping.pfllib_arguments(mapping.METHODS["FedProx"], split, "MNIST_x", 25, "tag")
    pairs = dict(zip(arguments[::2], arguments[1::2]))
    assert pairs["-algo"] == "FedProx" and pairs["-mu"] == "1.0" and pairs["-data"] == "MNIST_x"
    assert (pairs["-nc"], pairs["-ls"], pairs["-lbs"], pairs["-lr"], pairs["-gr"]) == ("20", "5", "100", "0.01", "25")


# --- running PFLlib: launcher, stubs, log ------------------------------------------------------

def test_launcher_adds_the_seed_to_every_torch_seed_and_seed_zero_is_unchanged(tmp_path):
    import torch

    system = tmp_path / "system"
    system.mkdir()
    (system / "main.py").write_text("import sys, torch\ntorch.manual_seed(0)\nprint(torch.rand(1).item(), sys.argv[1:])\n")
    launcher = pfllib_run.prepare_scratch(tmp_path / "scratch")

    def first_draw(seed: int) -> str:
        return subprocess.run([sys.executable, str(launcher), str(system), str(seed), "-gr", "3"],
                              capture_output=True, text=True, check=True).stdout.split()

    torch.manual_seed(0)
    expected = torch.rand(1).item()
    seed0, seed1 = first_draw(0), first_draw(1)
    assert float(seed0[0]) == pytest.approx(expected, abs=1e-7)
    assert seed0[1:] == ["['-gr',", "'3']"]
    assert float(seed1[0]) != pytest.approx(expected, abs=1e-7)


def test_stubs_import_but_refuse_to_be_used(tmp_path):
    pfllib_run.prepare_scratch(tmp_path)
    stubbed = [name for name in pfllib_run.STUBBED if (tmp_path / "stubs" / name).is_dir()]
    code = "import importlib, sys\n" + "".join(
        f"m = importlib.import_module('{name}')\ntry:\n    m.anything\nexcept ImportError as e:\n    print(e)\n"
        for name in stubbed)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={"PYTHONPATH": str(tmp_path / "stubs")})
    assert result.stdout.count("is a stub here") == len(stubbed)


PFLLIB_LOG = """
-------------Round number: 0-------------
Evaluate global models
Averaged Test Accuracy: 0.1000
Evaluate personalized models
Averaged Test Accuracy: 0.2000
-------------Round number: 1-------------
Evaluate global models
Averaged Test Accuracy: 0.3000
Evaluate personalized models
Averaged Test Accuracy: 0.4500
Best accuracy.
0.45
-------------Evaluate fine-tuned personalized models-------------
Averaged Test Accuracy: 0.9900
"""


def test_log_curve_takes_one_evaluation_per_round_and_ignores_what_follows_the_best():
    assert pfllib_run.curve_from_log(PFLLIB_LOG, "last") == {0: 0.2, 1: 0.45}
    assert pfllib_run.curve_from_log(PFLLIB_LOG, "first") == {0: 0.1, 1: 0.3}


# --- rows -----------------------------------------------------------------------------------------

def synthetic_curves(levels: dict[tuple[str, int], float], rounds: int = 12) -> pd.DataFrame:
    frames = [curves.curve_frame(library, seed, {r: level * r / rounds for r in range(1, rounds + 1)})
              for (library, seed), level in levels.items()]
    return pd.concat(frames, ignore_index=True)


def test_row_summarises_best_last10_and_round_of_best_per_side():
    data = synthetic_curves({("pfedkit", 0): 0.9, ("pfedkit", 1): 0.8, ("PFLlib", 0): 0.6, ("PFLlib", 1): 0.6})
    row = curves.compare("m", data, rounds=12)
    assert row.pfedkit.best == pytest.approx(85.0)
    assert row.pfedkit.last10 == pytest.approx(85.0 * 7.5 / 12)  # mean of rounds 3..12
    assert row.pfedkit.round_of_best == 12
    assert row.pfedkit.spread == pytest.approx(10.0 * 7.5 / 12)
    assert row.difference("best") == pytest.approx(25.0)
    assert not row.within_spread  # 15.6 points apart, seeds 6.25 apart


def test_row_agrees_when_the_difference_lies_within_the_seed_spread():
    data = synthetic_curves({("pfedkit", 0): 0.90, ("pfedkit", 1): 0.80, ("PFLlib", 0): 0.88, ("PFLlib", 1): 0.86})
    assert curves.compare("m", data, rounds=12).within_spread


def test_row_counts_only_seeds_evaluated_at_every_round():
    data = synthetic_curves({("pfedkit", 0): 0.9, ("PFLlib", 0): 0.9})
    unfinished = data[~((data["library"] == "PFLlib") & (data["round"] > 6))]
    row = curves.compare("m", unfinished, rounds=12)
    assert row.other is None and not row.complete
    assert "not run yet" in curves.markdown_row(row, "")


def test_row_compares_from_the_first_round_every_side_evaluated():
    """FL-bench's test path has no round 1 (CCVR): the row compares both sides over rounds 2..R, so
    pfedkit's round 1 counts neither for its best nor against a missing FL-bench point."""
    data = synthetic_curves({("pfedkit", 0): 0.9, ("FL-bench", 0): 0.9})
    data.loc[(data["library"] == "pfedkit") & (data["round"] == 1), "accuracy"] = 0.99  # pfedkit's best, round 1
    late = data[~((data["library"] == "FL-bench") & (data["round"] == 1))]
    assert curves.first_common_round(late) == 2 and curves.first_common_round(data) == 1
    assert not curves.compare("m", late, rounds=12).complete  # rounds 1..12 wanted: FL-bench lacks round 1
    row = curves.compare("m", late, rounds=12, first=2)
    assert row.complete and row.pfedkit.best == pytest.approx(90.0) and row.pfedkit.round_of_best == 12
    assert "12 (rounds 2-12 compared)" in curves.markdown_row(row, "agree")


# --- the facts FedDistill's rows rest on (pfedkit's distillation terms) ----------------------------

def test_pfllib_ce_term_is_unbounded_below_as_pfllib_d832e76_fd_loss_while_the_kl_is_not():
    """PFLlib d832e76's FD: CrossEntropyLoss(z, z̄_y) with raw logits as targets; a target with a
    negative entry lets the student lower the loss without end (both sides diverge: docs/conformance.md)."""
    import torch

    from pfedkit.algorithms.feddistill import distillation_term

    teacher = torch.tensor([[2.0, -3.0, 0.5]])
    labels, has_target = torch.tensor([0]), torch.tensor([True])
    direction = torch.tensor([[1.0, -1.0, 0.0]])
    ce = [distillation_term(scale * direction, labels, teacher, has_target, "pfllib_ce").item() for scale in (1, 10, 100)]
    kl = [distillation_term(scale * direction, labels, teacher, has_target, "kl").item() for scale in (1, 10, 100)]
    assert ce[0] > ce[1] > ce[2] and ce[2] < -100
    assert min(kl) >= 0


def test_kl_term_has_the_gradient_of_cross_entropy_to_softmax_targets_pfllib_87689a0():
    import torch
    import torch.nn.functional as F

    from pfedkit.algorithms.feddistill import distillation_term

    generator = torch.Generator().manual_seed(0)
    teacher = torch.randn(3, 3, generator=generator)
    logits = torch.randn(4, 3, generator=generator, requires_grad=True)
    labels, has_target = torch.tensor([0, 2, 1, 2]), torch.tensor([True, True, True])
    (kl_grad,) = torch.autograd.grad(distillation_term(logits, labels, teacher, has_target, "kl"), logits)
    ce = F.cross_entropy(logits, teacher[labels].softmax(dim=1))
    (ce_grad,) = torch.autograd.grad(ce, logits)
    torch.testing.assert_close(kl_grad, ce_grad)


def test_paired_differences_use_only_seeds_both_sides_completed():
    data = synthetic_curves({("pfedkit", 0): 0.9, ("pfedkit", 1): 0.8, ("PFLlib", 0): 0.6})
    assert curves.paired_last10(data, rounds=12) == {0: pytest.approx(30.0 * 7.5 / 12)}


def test_a_method_whose_pfllib_rounds_are_one_training_in_is_shifted_onto_pfedkits_rounds(tmp_path):
    """FedPHP: PFLlib's 'Round number: r' evaluates after r + 1 trainings, pfedkit's round r + 1;
    the curves file holds PFLlib's rounds shifted by the method's pfllib_round_shift, others not."""
    import conformance
    split = mapping.SPLITS["mnist_fedrema"]
    for label, shift in (("FedPHP", 1), ("FedAvg", 0)):
        method = mapping.METHODS[label]
        assert method.pfllib_round_shift == shift
        log = conformance.pfllib_log(tmp_path, split, method, 0)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(PFLLIB_LOG)
        got = conformance.collect_curves(tmp_path, split, method, [0])
        assert dict(zip(got["round"], got["accuracy"])) == {0 + shift: 0.2, 1 + shift: 0.45}


# --- pfedkit from PFLlib's initial weights (--init pfllib) ------------------------------------

FAKE_MODELS = '''import torch
from torch import nn


class FedAvgCNN(nn.Module):  # a stand-in of PFLlib's: each layer inside an nn.Sequential
    def __init__(self, in_features=1, num_classes=10, dim=1024):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(in_features, 2, 3), nn.ReLU())
        self.fc = nn.Linear(dim, num_classes)
'''


def test_pfllib_initial_weights_are_its_models_under_the_seed_named_as_pfedkit_names_layers(tmp_path):
    import torch
    from torch import nn

    models = tmp_path / "checkout" / "system" / "flcore" / "trainmodel"
    models.mkdir(parents=True)
    (models / "models.py").write_text(FAKE_MODELS)
    (tmp_path / "checkout" / "system" / "main.py").write_text("")  # what makes a folder a PFLlib checkout
    weights = {}
    for seed in (0, 1):
        out = pfllib_run.pfllib_initial_weights(tmp_path / "checkout", tmp_path / "scratch", seed, (3, 4, 8),
                                                tmp_path / "init" / f"s{seed}.pt")
        weights[seed] = torch.load(out, weights_only=True)
        torch.manual_seed(seed)  # PFLlib's main.py: torch.manual_seed(0), shifted by the seed
        conv, fc = nn.Conv2d(3, 2, 3), nn.Linear(8, 4)
        expected = {"conv1.weight": conv.weight, "conv1.bias": conv.bias, "fc.weight": fc.weight, "fc.bias": fc.bias}
        assert list(weights[seed]) == list(expected)
        assert all(torch.equal(weights[seed][name], tensor) for name, tensor in expected.items())
    assert not torch.equal(weights[0]["fc.weight"], weights[1]["fc.weight"])
    assert pfllib_run.pfedkit_layer_name("fc1.0.weight") == "fc1.weight"


def test_init_runs_have_their_own_directories_and_need_the_checkout(tmp_path):
    import conformance
    split, method = mapping.SPLITS["mnist_fedrema"], mapping.METHODS["FedAvg"]
    plain = conformance.pfedkit_run_dir(tmp_path, split, method, 1)
    init = conformance.pfedkit_run_dir(tmp_path, split, method, 1, "pfllib")
    assert plain.name == "FedAvg-s1" and init.name == "FedAvg-pfllib-init-s1" and init.parent == plain.parent
    with pytest.raises(SystemExit, match="--init pfllib reads PFLlib's initial weights"):
        conformance.main(["run", "--scratch", str(tmp_path), "--split", "mnist_fedrema", "--method", "FedAvg",
                          "--side", "pfedkit", "--init", "pfllib"])


def test_a_cut_pfedkit_run_is_resumed_and_a_finished_one_kept(tmp_path):
    """Rerunning a row must not start NAME-2 beside a cut NAME whose curve would then be read."""
    import conformance
    run_dir = tmp_path / "FedAvg-s0"
    assert conformance.pfedkit_command(run_dir, ["split.yaml", "seed=0"])[-3:] == ["run", "split.yaml", "seed=0"]
    run_dir.mkdir()
    assert conformance.pfedkit_command(run_dir, ["split.yaml", "seed=0"])[-3:] == ["run", "--resume", str(run_dir)]
    (run_dir / "summary.json").write_text("{}")
    assert conformance.pfedkit_command(run_dir, ["split.yaml", "seed=0"]) is None
