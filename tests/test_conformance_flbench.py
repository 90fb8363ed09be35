"""benchmarks/conformance against FL-bench: the export to its format, its stubs, the mapping, its curves."""
from __future__ import annotations

import importlib.util
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from conftest import SHARED_DATASETS, needs_dataset

CONFORMANCE = Path(__file__).resolve().parent.parent / "benchmarks" / "conformance"
sys.path.insert(0, str(CONFORMANCE))

import conformance  # noqa: E402
import curves  # noqa: E402
import flbench_data  # noqa: E402
import flbench_mapping  # noqa: E402
import flbench_methods  # noqa: E402
import flbench_run  # noqa: E402
import mapping  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MNIST_NORMALISATION = ([0.1307], [0.3015])          # FL-bench's DATA_MEAN / DATA_STD of mnist
CIFAR_NORMALISATION = ([0.4914, 0.4822, 0.4465], [0.2023, 0.1994, 0.201])


def tiny_partition(overrides: list[str]):
    from pfedkit.federation import resolve_partition

    return resolve_partition(overrides)


# --- the export ---------------------------------------------------------------------------------

@pytest.mark.parametrize("channels, normalisation, layout", [
    (1, MNIST_NORMALISATION, (7, 5, 4)), (3, CIFAR_NORMALISATION, (7, 5, 4, 3))])
def test_stored_samples_are_in_torchvision_layout_and_flbench_turns_them_back_into_the_rows(
        channels, normalisation, layout):
    rows = np.random.default_rng(0).uniform(-1, 1, (7, channels, 5, 4)).astype(np.float32)
    samples = flbench_data.stored_samples(rows, *normalisation)
    assert samples.shape == layout and samples.dtype == np.float32
    assert samples.max() > 1.0  # FL-bench divides by 255 only then
    np.testing.assert_allclose(flbench_data.flbench_inputs(samples, *normalisation), rows, atol=2e-6, rtol=0)
    mean, std = normalisation
    # the stored sample of the first channel is 255 (mean + std x): not the rows themselves, not x * 255
    first = samples[..., 0] if channels > 1 else samples
    np.testing.assert_allclose(first, 255 * (mean[0] + std[0] * rows[:, 0]), atol=1e-4, rtol=0)


def tiny_images(channels: int, seed: int = 0):
    """A 40-image pfedkit Dataset (uint8, stored as the image sets are) and three clients' rows."""
    from pfedkit.data.store import Dataset

    rng = np.random.default_rng(seed)
    shape = (40, 6, 6) if channels == 1 else (40, 6, 6, channels)
    dataset = Dataset("tiny", rng.integers(0, 256, shape, dtype=np.uint8), rng.integers(0, 10, 40).astype(np.int64),
                      np.zeros(40, bool), 10)
    order = rng.permutation(40)
    return dataset, [order[0:9], order[15:20], order[25:37]], [order[9:15], order[20:25], order[37:40]]


@pytest.mark.parametrize("channels, normalisation", [(1, MNIST_NORMALISATION), (3, CIFAR_NORMALISATION)])
def test_export_reads_back_as_flbench_computes_the_same_rows_labels_and_clients(tmp_path, channels, normalisation):
    dataset, train_index, test_index = tiny_images(channels)
    out = flbench_data.export_to_flbench(tmp_path / "tiny", dataset, train_index, test_index, {"seed": 0},
                                         *normalisation)
    clients = flbench_data.read_back(out)
    assert len(clients) == 3
    for cid, client in enumerate(clients):
        np.testing.assert_allclose(client.train_x, dataset.rows(train_index[cid]), atol=2e-6, rtol=0)
        np.testing.assert_allclose(client.test_x, dataset.rows(test_index[cid]), atol=2e-6, rtol=0)
        np.testing.assert_array_equal(client.train_y, dataset.y[train_index[cid]])
        np.testing.assert_array_equal(client.test_y, dataset.y[test_index[cid]])
    assert flbench_data.max_input_error(out, dataset, train_index, test_index) < 2e-6


def test_partition_file_holds_every_client_with_disjoint_rows_covering_the_samples(tmp_path):
    dataset, train_index, test_index = tiny_images(1, seed=1)
    out = flbench_data.export_to_flbench(tmp_path / "d", dataset, train_index, test_index, {"seed": 1},
                                         *MNIST_NORMALISATION)
    with open(out / flbench_data.PARTITION, "rb") as handle:
        partition = pickle.load(handle)
    assert partition["separation"] == {"train": [0, 1, 2], "val": [0, 1, 2], "test": [0, 1, 2], "total": 3}
    rows = np.concatenate([np.concatenate([c["train"], c["val"], c["test"]]) for c in partition["data_indices"]])
    assert sorted(rows.tolist()) == list(range(len(np.load(out / flbench_data.TARGETS))))  # disjoint, covering
    assert [len(c["train"]) for c in partition["data_indices"]] == [len(t) for t in train_index]
    assert [len(c["test"]) for c in partition["data_indices"]] == [len(t) for t in test_index]
    assert all(len(c["val"]) == 0 for c in partition["data_indices"])


def test_export_refuses_rows_that_are_not_images(tmp_path):
    config, dataset, train_index, test_index = tiny_partition(["dataset=digits", "num_clients=2", "seed=0"])
    with pytest.raises(SystemExit, match="images"):
        flbench_data.export_to_flbench(tmp_path / "d", dataset, train_index, test_index, {}, *MNIST_NORMALISATION)


def test_export_refuses_a_folder_with_files(tmp_path):
    (tmp_path / "old.txt").write_text("x")
    with pytest.raises(SystemExit, match="not empty"):
        flbench_data.export_to_flbench(tmp_path, None, [], [], {}, *MNIST_NORMALISATION)


@needs_dataset("mnist")
def test_export_of_the_mnist_split_gives_flbench_the_rows_pfedkit_trains_on(tmp_path):
    config, dataset, train_index, test_index = tiny_partition(
        [str(mapping.SPLITS["mnist_fedrema"].config), "num_clients=5", "partition.samples_per_client=20",
         f"data_dir={SHARED_DATASETS}"])
    out = flbench_data.export_to_flbench(tmp_path / "mnist", dataset, train_index, test_index, config.to_dict(),
                                         *MNIST_NORMALISATION)
    assert flbench_data.max_input_error(out, dataset, train_index, test_index) < 2e-6
    assert [len(c.train_y) for c in flbench_data.read_back(out)] == [16] * 5


# --- the stubs ----------------------------------------------------------------------------------

def stub_module(stubs: Path, name: str):
    spec = importlib.util.spec_from_file_location(f"stub_{name}", stubs / "torchvision" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_torchvision_stub_serves_the_export_and_normalises_as_flbench_expects(tmp_path, monkeypatch):
    monkeypatch.setattr(flbench_run, "torchvision_loads", lambda: False)
    stubs = flbench_run.prepare_stubs(tmp_path)
    samples = flbench_data.stored_samples(np.full((2, 3, 4, 4), 0.5, np.float32), *CIFAR_NORMALISATION)
    np.save(tmp_path / flbench_data.SAMPLES, samples)
    np.save(tmp_path / flbench_data.TARGETS, np.array([3, 7]))
    datasets = stub_module(stubs, "datasets")
    train, test = datasets.CIFAR10(tmp_path, True, download=True), datasets.CIFAR10(tmp_path, False)
    np.testing.assert_array_equal(train.data, samples)
    assert list(train.targets) == [3, 7] and len(test.data) == 0 and test.data.shape[1:] == samples.shape[1:]
    import torch

    transforms = stub_module(stubs, "transforms")
    normalise = transforms.Compose([transforms.Normalize(*CIFAR_NORMALISATION)])
    image = torch.tensor(samples[0]).permute(2, 0, 1) / 255.0
    np.testing.assert_allclose(normalise(image).numpy(), np.full((3, 4, 4), 0.5), atol=2e-6)


def test_stubs_import_but_refuse_to_be_used(tmp_path, monkeypatch):
    monkeypatch.setattr(flbench_run, "torchvision_loads", lambda: False)
    stubs = flbench_run.prepare_stubs(tmp_path)
    code = ("import torchvision.models as m, torchvision.transforms as t\n"
            "weights = m.ResNet18_Weights.DEFAULT\n"  # FL-bench's class bodies name these at import
            "for call in (lambda: m.resnet18(weights=weights), lambda: t.Resize(3)):\n"
            "    try:\n        call()\n    except ImportError as e:\n        print(e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={"PYTHONPATH": str(stubs)})
    assert result.stdout.count("not in the conformance stub") == 2


def test_a_stub_left_for_a_package_installed_since_is_removed(tmp_path, monkeypatch):
    stubs = tmp_path / "flbench" / "stubs"
    monkeypatch.setattr(flbench_run, "STUBBED", {"json": "a test", "no_such_package_here": "a test"})
    monkeypatch.setattr(flbench_run, "torchvision_loads", lambda: False)
    (stubs / "json").mkdir(parents=True)
    (stubs / "json" / "__init__.py").write_text("raise ImportError")  # written before json was 'installed'
    flbench_run.prepare_stubs(tmp_path)
    assert not (stubs / "json").exists() and (stubs / "no_such_package_here" / "__init__.py").is_file()


def test_a_folder_that_is_not_an_flbench_checkout_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="not an FL-bench checkout"):
        flbench_run.flbench_root(tmp_path)


# --- the mapping --------------------------------------------------------------------------------

@pytest.mark.parametrize("label", sorted(flbench_methods.FLBENCH_METHODS))
def test_every_pfedkit_value_of_the_protocol_is_what_the_run_resolves_to(label):
    from pfedkit.config import load_config

    method, split = flbench_methods.FLBENCH_METHODS[label], mapping.SPLITS["mnist_fedrema"]
    config = load_config(str(split.config), flbench_mapping.flbench_pfedkit_overrides(method, split, 3, 7)).to_dict()
    for setting in flbench_mapping.FLBENCH_PROTOCOL:
        value = mapping.dotted(config, setting.pfedkit_key)  # KeyError: a key pfedkit does not have
        if setting.pfedkit_value is not None:
            assert value == setting.pfedkit_value, setting.pfedkit_key
    assert config["algorithm"] == method.pfedkit and config["seed"] == 3 and config["rounds"] == 7
    split_config = mapping.read_split_config(split)
    for key, value in method.pfedkit_options.items():
        assert mapping.dotted(config, key) == mapping.resolve_placeholder(value, split_config), key


def test_paired_batches_are_the_meta_steps_batches_of_equal_clients_and_refused_otherwise():
    config = mapping.read_split_config(mapping.SPLITS["mnist_fedrema"])
    assert mapping.paired_batches(config) == 2 * 5 * 2  # 480 rows: 5 batches of 100, 2 pairs an epoch
    odd = {**config, "batch_size": 60, "local_epochs": 3}  # 8 batches: 4 pairs an epoch
    assert mapping.paired_batches(odd) == 2 * 3 * 4
    assert mapping.resolve_placeholder("PAIRED_BATCHES", odd) == 24
    with pytest.raises(SystemExit, match="the same size"):
        mapping.paired_batches(mapping.read_split_config(mapping.SPLITS["cifar10_dir01"]))


def test_flbench_arguments_run_one_epoch_more_than_the_rounds_under_the_seed():
    split = mapping.SPLITS["mnist_fedrema"]
    arguments = flbench_mapping.flbench_arguments(flbench_methods.FLBENCH_METHODS["FedAvg"], split, 25, 4)
    pairs = dict(argument.split("=", 1) for argument in arguments)
    assert pairs["method"] == "fedavg" and pairs["dataset.name"] == "mnist" and pairs["model.name"] == "avgcnn"
    assert (pairs["common.global_epoch"], pairs["common.seed"], pairs["common.local_epoch"],
            pairs["common.batch_size"], pairs["optimizer.lr"], pairs["common.join_ratio"]) == (
        "26", "4", "5", "100", "0.01", "1.0")
    assert pairs["common.use_cuda"] == "false" and pairs["common.test.client.test"] == "true"


def test_a_methods_own_setting_replaces_the_fixed_one_once():
    split = mapping.SPLITS["mnist_fedrema"]
    arguments = flbench_mapping.flbench_arguments(flbench_methods.FLBENCH_METHODS["CCVR"], split, 25, 0)
    interval = [a for a in arguments if "common.test.client.interval=" in a]
    assert interval == ["++common.test.client.interval=1"]


# --- curves -------------------------------------------------------------------------------------

def test_curve_of_flbench_metrics_is_the_before_column_as_a_fraction_by_epoch(tmp_path):
    path = tmp_path / "metrics.csv"
    pd.DataFrame({"epoch": [0, 1, 2], "accuracy_test_before": [10.0, 55.5, 70.0],
                  "accuracy_test_after": [60.0, 80.0, 90.0]}).to_csv(path, index=False)
    assert flbench_run.curve_from_metrics(path) == {0: 0.10, 1: 0.555, 2: 0.70}


def test_metrics_file_is_the_newest_finished_run_of_the_method(tmp_path):
    assert flbench_run.metrics_file(tmp_path, "fedavg", "mnist") is None
    for stamp in ("2026-01-01-00-00-00", "2026-02-01-00-00-00"):
        (tmp_path / "out" / "fedavg" / "mnist" / stamp).mkdir(parents=True)
        (tmp_path / "out" / "fedavg" / "mnist" / stamp / "metrics.csv").write_text("epoch\n")
    (tmp_path / "out" / "fedavg" / "mnist" / "2026-03-01-00-00-00").mkdir()  # cut: no metrics.csv
    assert flbench_run.metrics_file(tmp_path, "fedavg", "mnist").parent.name == "2026-02-01-00-00-00"
    assert flbench_run.metrics_file(tmp_path, "local", "mnist") is None


def test_row_compares_pfedkit_with_flbench_when_the_file_holds_flbench():
    frames = [curves.curve_frame(library, seed, {r: level * r / 12 for r in range(1, 13)})
              for library, seed, level in [("pfedkit", 0, 0.9), ("pfedkit", 1, 0.8),
                                           ("FL-bench", 0, 0.6), ("FL-bench", 1, 0.6)]]
    data = pd.concat(frames, ignore_index=True)
    row = curves.compare("m", data, rounds=12)
    assert row.other_library == "FL-bench" and row.difference("best") == pytest.approx(25.0)
    assert "pfedkit − FL-bench" in curves.table_header(row.other_library)
    assert set(curves.paired_last10(data, 12)) == {0, 1}
    with pytest.raises(ValueError, match="one library"):
        curves.other_library(pd.concat([data, curves.curve_frame("PFLlib", 0, {1: 0.5})]))


def test_collect_curves_reads_pfedkit_flbench_runs_and_flbench_metrics(tmp_path):
    split, method = mapping.SPLITS["mnist_fedrema"], flbench_methods.FLBENCH_METHODS["FedAvg"]
    folder = tmp_path / "flbench" / "run" / "mnist_fedrema-s0" / "FedAvg" / "out" / "fedavg" / "mnist" / "t"
    folder.mkdir(parents=True)
    pd.DataFrame({"epoch": [0, 1, 2], "accuracy_test_before": [10.0, 50.0, 60.0]}).to_csv(
        folder / "metrics.csv", index=False)
    run_dir = conformance.pfedkit_run_dir(tmp_path, split, method, 0, against="FL-bench")
    assert run_dir.name == "FedAvg-flbench-s0"
    collected = conformance.collect_curves(tmp_path, split, method, [0], against="FL-bench")
    assert set(collected["library"]) == {"FL-bench"} and list(collected["accuracy"]) == [0.1, 0.5, 0.6]


# --- the command line ---------------------------------------------------------------------------

@pytest.mark.parametrize("arguments, message", [
    (["--method", "FedAvg"], "--flbench CHECKOUT is needed"),
    (["--method", "FedAvg", "--side", "PFLlib"], "--side is both, pfedkit or FL-bench"),
    (["--method", "APPLE"], "not mapped against FL-bench"),
    (["--method", "SCAFFOLD", "--flbench", "x"], "not comparable against FL-bench: FL-bench never stores"),
])
def test_run_against_flbench_refuses_what_it_cannot_run(tmp_path, arguments, message):
    with pytest.raises(SystemExit, match=message):
        conformance.main(["run", "--against", "FL-bench", "--scratch", str(tmp_path), "--split", "mnist_fedrema",
                          *arguments])


def test_side_flbench_needs_against_flbench(tmp_path):
    with pytest.raises(SystemExit, match="--against FL-bench"):
        conformance.main(["run", "--scratch", str(tmp_path), "--split", "mnist_fedrema", "--method", "FedAvg",
                          "--side", "FL-bench"])


# --- curves read from main.log (methods whose evaluated model metrics.csv does not hold) ----------

MAIN_LOG = """==================== pFedHN ====================
Experiment Arguments:
{
│   'method': 'pfedhn',
}
---------------------------- TRAINING EPOCH: 1 ----------------------------
client [1]  (testset)   loss: 2.3221 -> 1.5519  accuracy: 10.00% -> 68.33%
client [0]  (testset)   loss: 2.2896 -> 1.5550  accuracy: 40.00% -> 78.33%
---------------------------- TRAINING EPOCH: 2 ----------------------------
client [0]  (testset)   loss: 1.2 -> 1.0  accuracy: 50.00% -> 80.00%
client [1]  (testset)   loss: 1.1 -> 0.9  accuracy: 70.00% -> 90.00%
---------------------------- TRAINING EPOCH: 3 ----------------------------
client [0]  (testset)   loss: 1.2 -> 1.0  accuracy: 60.00% -> 80.00%
==================== pFedHN Experiment Results: ====================
Display format: (before local fine-tuning) -> (after local fine-tuning)
{
    "1": {
        "all_clients": {
            "test": {
                "loss": "2.3000 -> 0.0000",
                "accuracy": "12.34% -> 0.00%"
            }
        }
    },
    "2": {
        "all_clients": {
            "test": {
                "loss": "1.3000 -> 0.0000",
                "accuracy": "56.78% -> 0.00%"
            }
        }
    }
}
"""


def test_client_lines_pool_every_clients_before_accuracy_by_test_rows_and_skip_partial_epochs():
    curve = flbench_run.curve_from_client_lines(MAIN_LOG, test_rows=[100, 300])
    assert set(curve) == {0, 1}  # epoch 3 (index 2) lacks client 1
    assert curve[0] == pytest.approx((40 * 100 + 10 * 300) / 400 / 100)  # the 'before' values, not 'after'
    assert curve[1] == pytest.approx((50 * 100 + 70 * 300) / 400 / 100)


def test_test_results_are_the_closing_json_accuracies_by_key_either_side():
    assert flbench_run.curve_from_test_results(MAIN_LOG) == {1: pytest.approx(0.1234), 2: pytest.approx(0.5678)}
    fine_tuned = MAIN_LOG.replace('"12.34% -> 0.00%"', '"12.34% -> 81.50%"').replace('"56.78% -> 0.00%"',
                                                                                      '"56.78% -> 90.25%"')
    assert flbench_run.curve_from_test_results(fine_tuned, "after") == {1: pytest.approx(0.815), 2: pytest.approx(0.9025)}
    assert flbench_run.curve_from_test_results("no results yet") == {}


@pytest.mark.parametrize("curve, expected", [("before", {1: 0.5}), ("clients", {0: 0.25, 1: 0.6}),
                                             ("test_results", {2: 0.1234, 3: 0.5678})])
def test_collect_curves_reads_each_method_where_its_evaluated_model_is_and_shifts_its_rounds(
        tmp_path, curve, expected):
    import json

    split = mapping.SPLITS["mnist_fedrema"]
    method = flbench_mapping.FlbenchMethod("X", "fedavg", "x", curve=curve, round_shift=1 if curve == "test_results" else 0)
    out = tmp_path / "flbench" / "run" / "mnist_fedrema-s0" / "X" / "out" / "x" / "mnist" / "t"
    out.mkdir(parents=True)
    pd.DataFrame({"epoch": [1], "accuracy_test_before": [50.0]}).to_csv(out / "metrics.csv", index=False)
    (out / "main.log").write_text(MAIN_LOG)
    export = tmp_path / "flbench" / "data" / "mnist_fedrema-s0" / "mnist"
    export.mkdir(parents=True)
    (export / "pfedkit_export.json").write_text(json.dumps({"test_rows": [120, 120]}))
    collected = conformance.collect_curves(tmp_path, split, method, [0], against="FL-bench")
    assert dict(zip(collected["round"], collected["accuracy"])) == pytest.approx(expected)


@pytest.mark.parametrize("label", sorted(flbench_methods.FLBENCH_METHODS))
def test_each_method_reads_a_curve_its_flbench_run_writes(label):
    """A curve from FL-bench's test path needs that path switched on; the other curves need it off
    (the test path draws from FL-bench's random streams and changes its training batches)."""
    method = flbench_methods.FLBENCH_METHODS[label]
    assert method.curve in ("before", "clients", "test_results", "test_results_after")
    testing = method.flbench_options.get("common.test.client.interval", -1)
    assert (testing == 1) == method.curve.startswith("test_results"), (method.curve, testing)
    assert method.round_shift in (0, 1)


def test_a_method_flbench_cannot_check_is_not_also_mapped():
    assert not set(flbench_methods.FLBENCH_METHODS) & set(flbench_methods.FLBENCH_NOT_COMPARABLE)
    from pfedkit.algorithms import algorithm_names

    assert {m.pfedkit for m in flbench_methods.FLBENCH_METHODS.values()} <= set(algorithm_names())


# --- pfedkit from FL-bench's initial weights (--init flbench) -----------------------------------

FAKE_FLBENCH_MODELS = '''from collections import OrderedDict

import torch
from torch import nn


class FedAvgCNN(nn.Module):  # a stand-in of FL-bench's: the body in `base`, the last layer `classifier`
    def __init__(self, dataset, pretrained):
        super().__init__()
        self.base = nn.Sequential(OrderedDict(conv1=nn.Conv2d(1, 2, 3), activation1=nn.ReLU()))
        self.classifier = nn.Linear(8, 10)
'''


def test_flbench_initial_weights_are_its_model_under_the_seed_named_as_pfedkit_names_layers(tmp_path):
    import torch
    from torch import nn

    checkout = tmp_path / "checkout"
    (checkout / "src" / "utils").mkdir(parents=True)
    (checkout / "src" / "server").mkdir(parents=True)
    (checkout / "src" / "utils" / "models.py").write_text(FAKE_FLBENCH_MODELS)
    (checkout / "src" / "server" / "fedavg.py").write_text("")  # with main.py: what makes a folder a checkout
    (checkout / "main.py").write_text("")
    weights = {}
    for seed in (0, 3):
        out = flbench_run.flbench_initial_weights(checkout, tmp_path / "scratch", seed, "mnist",
                                                  tmp_path / "init" / f"s{seed}.pt")
        weights[seed] = torch.load(out, weights_only=True)
        torch.manual_seed(seed)  # FL-bench's fix_random_seed, then the model
        conv, fc = nn.Conv2d(1, 2, 3), nn.Linear(8, 10)
        expected = {"conv1.weight": conv.weight, "conv1.bias": conv.bias, "fc.weight": fc.weight, "fc.bias": fc.bias}
        assert list(weights[seed]) == list(expected)
        assert all(torch.equal(weights[seed][name], tensor) for name, tensor in expected.items())
    assert not torch.equal(weights[0]["fc.weight"], weights[3]["fc.weight"])
    assert not list(checkout.rglob("__pycache__"))  # nothing written into the checkout


def test_pfedkit_names_the_flbench_layers_as_its_own_cnn_does():
    from pfedkit.models.cnn import FedAvgCNN

    names = set(FedAvgCNN((1, 28, 28), 10).state_dict())
    flbench = ["base.conv1.weight", "base.conv1.bias", "base.conv2.weight", "base.conv2.bias", "base.fc1.weight",
               "base.fc1.bias", "classifier.weight", "classifier.bias"]
    renamed = {flbench_run.pfedkit_layer_name(name) for name in flbench}
    assert renamed <= {n.split(".", 1)[1] if n.startswith(("body.", "head.")) else n for n in names}


def test_init_flbench_runs_have_their_own_directories_and_need_the_checkout(tmp_path):
    split, method = mapping.SPLITS["mnist_fedrema"], flbench_methods.FLBENCH_METHODS["FedAvg"]
    assert conformance.pfedkit_run_dir(tmp_path, split, method, 2, "flbench", "FL-bench").name == "FedAvg-flbench-init-s2"
    with pytest.raises(SystemExit, match="--init flbench reads FL-bench's initial weights"):
        conformance.main(["run", "--against", "FL-bench", "--scratch", str(tmp_path), "--split", "mnist_fedrema",
                          "--method", "FedAvg", "--side", "pfedkit", "--init", "flbench"])
    with pytest.raises(SystemExit, match="--init flbench runs with --against FL-bench"):
        conformance.main(["run", "--scratch", str(tmp_path), "--split", "mnist_fedrema", "--method", "FedAvg",
                          "--side", "pfedkit", "--init", "flbench", "--pfllib", "x"])
