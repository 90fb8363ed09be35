"""Bad input, as a new user types it: every case ends with one `error:` line naming the culprit,
exit status 2, no traceback, and nothing left behind (no run directory, no cached dataset).

The command line runs in this process (`pfedkit.cli.main`), from an empty working directory, so
anything a command would create by default (`runs/...`) shows up there.
"""
from __future__ import annotations

import io
import lzma
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from pfedkit.cli import build_parser, main
from pfedkit.config import load_config
from pfedkit.core.errors import ConfigWarning
from pfedkit.experiments.paper_presets import PAPERS

def _writes_into_read_only_folders() -> bool:
    """True for root with its usual capabilities: permission bits cannot make a folder read-only."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "read-only"
        folder.mkdir(mode=0o555)
        try:
            (folder / "probe").write_text("")
            return True
        except PermissionError:
            return False
        finally:
            folder.chmod(0o755)


WRITES_ANYWHERE = _writes_into_read_only_folders()


# ---------------------------------------------------------------------------------------------
# Inputs: fake `mnist` data directories, config files, a finished run
# ---------------------------------------------------------------------------------------------

def _npz_bytes(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _write_dataset(root: Path, payload: bytes, xz: bool = True) -> Path:
    (root / "mnist").mkdir(parents=True)
    (root / "mnist" / "mnist.npz.xz").write_bytes(lzma.compress(payload) if xz else payload)
    return root


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """Data directories named after what is wrong with their `mnist` file, config files, a file
    to put paths under, and a finished run (for `report`)."""
    root = tmp_path_factory.mktemp("inputs")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (200, 28, 28), dtype=np.uint8)
    y = np.arange(200) % 10
    test = np.arange(200) % 4 == 0
    _write_dataset(root / "good", _npz_bytes(x=x, y=y, test=test))
    _write_dataset(root / "not_npz", b"plain text, not an npz archive")
    _write_dataset(root / "npy_not_npz", _npy_bytes(y))
    _write_dataset(root / "corrupt_xz", b"not xz at all", xz=False)
    _write_dataset(root / "lacks_test", _npz_bytes(x=x, y=y))
    _write_dataset(root / "length_mismatch", _npz_bytes(x=x, y=y[:150], test=test))
    _write_dataset(root / "labels_out_of_range", _npz_bytes(x=x, y=y + 5, test=test))
    _write_dataset(root / "float_labels", _npz_bytes(x=x, y=y.astype(np.float32), test=test))
    _write_dataset(root / "wrong_shape", _npz_bytes(x=x[:, :20, :20], y=y, test=test))
    _write_dataset(root / "checksum", _npz_bytes(x=x, y=y, test=test))
    (root / "checksum" / "SHA256SUMS").write_text("0" * 64 + "  mnist/mnist.npz.xz\n")
    (root / "empty").mkdir()
    (root / "afile").write_text("a file, not a folder")
    (root / "bad.yaml").write_text("rounds: [1\nlr: 2\n")
    (root / "list.yaml").write_text("- rounds\n- lr\n")
    (root / "unknown_key.yaml").write_text("rounds: 1\nlearning_rate: 0.1\n")
    assert main(["run", "-q", "rounds=1", "num_clients=2", f"out_dir={root / 'done'}", "name=run"]) == 0
    _write_damaged_and_foreign_inputs(root)
    return root


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------------
# The table: (id, argv, culprit). In argv, {in} is the inputs folder and {out} the run folder.
# ---------------------------------------------------------------------------------------------

MNIST = ["dataset=mnist", "rounds=1"]

CASES = [
    # keys and values
    ("unknown key", ["run", "-q", "lrr=0.1"], "lrr"),
    ("unknown nested key", ["run", "-q", "partition.alpah=0.1"], "partition.alpah"),
    ("unknown algorithm option", ["run", "-q", "algorithm=fedprox", "fedprox.muu=1"], "fedprox.muu"),
    ("unknown section", ["run", "-q", "fedprx.mu=1"], "fedprx"),
    ("alpha zero", ["run", "-q", "partition.alpha=0"], "partition.alpha"),
    ("alpha negative", ["run", "-q", "partition.alpha=-1"], "partition.alpha"),
    ("more classes per client than classes",
     ["run", "-q", "partition.scheme=pathological", "partition.classes_per_client=11"], "partition.classes_per_client"),
    ("nway_kshot ways", ["run", "-q", "partition.scheme=nway_kshot", "partition.n=10"], "partition.n"),
    ("more clients than samples", ["run", "-q", "num_clients=5000"], "num_clients"),
    ("no clients", ["run", "-q", "num_clients=0"], "num_clients"),
    ("unknown algorithm", ["run", "-q", "algorithm=fedavgg"], "fedavgg"),
    ("unknown dataset", ["run", "-q", "dataset=mnistt"], "mnistt"),
    ("unknown model", ["run", "-q", "model=cnnn"], "cnnn"),
    ("unknown model option", ["run", "-q", "model_options.colour=red"], "colour"),
    ("unknown scheme", ["run", "-q", "partition.scheme=stripes"], "partition.scheme"),
    ("unknown preset", ["run", "-q", "preset=pfllb"], "pfllb"),
    ("unparsable list", ["run", "-q", "lr=["], "lr=["),
    ("unparsable json", ["run", "-q", "client_model_options={bad json"], "client_model_options={bad json"),
    ("unparsable section", ["run", "-q", "partition={scheme: iid"], "partition={scheme: iid"),
    ("text for a number", ["run", "-q", "lr=fast"], "lr"),
    ("negative lr", ["run", "-q", "lr=-0.1"], "lr"),
    ("zero rounds", ["run", "-q", "rounds=0"], "rounds"),
    ("zero batch", ["run", "-q", "batch_size=0"], "batch_size"),
    ("join ratio above 1", ["run", "-q", "join_ratio=1.5"], "join_ratio"),
    ("unknown headline point", ["run", "-q", "headline.point=median"], "headline.point"),
    ("override without value", ["run", "-q", "rounds=1", "lr"], "lr"),
    ("heterogeneous models with fedavg", ["run", "-q", 'client_model_options={"0-3": {}}'], "client_model_options"),
    ("option beyond the model", ["run", "-q", "algorithm=cwfedavg", "cwfedavg.class_wise_layers=9"],
     "cwfedavg.class_wise_layers"),
    # files and folders
    ("out_dir under a file", ["run", "-q", "rounds=1", "out_dir={in}/afile/runs"], "afile"),
    ("missing config file", ["run", "-q", "{in}/nosuch.yaml"], "nosuch.yaml"),
    ("config file is a folder", ["run", "-q", "{in}/empty"], "empty"),
    ("invalid YAML file", ["run", "-q", "{in}/bad.yaml"], "bad.yaml"),
    ("YAML file of a list", ["run", "-q", "{in}/list.yaml"], "list.yaml"),
    ("unknown key in a file", ["run", "-q", "{in}/unknown_key.yaml"], "learning_rate"),
    ("resume a folder that is no run", ["run", "-q", "--resume", "{in}/empty"], "empty"),
    ("resume with overrides", ["run", "-q", "--resume", "{in}/done/run", "lr=1"], "--resume"),
    # data files
    ("no data directory", ["run", "-q", *MNIST], "data_dir"),
    ("data directory without the file", ["run", "-q", *MNIST, "data_dir={in}/empty"], "{in}/empty/mnist/mnist.npz.xz"),
    ("data directory is a file", ["run", "-q", *MNIST, "data_dir={in}/afile"], "{in}/afile/mnist/mnist.npz.xz"),
    ("corrupt xz", ["run", "-q", *MNIST, "data_dir={in}/corrupt_xz"], "{in}/corrupt_xz/mnist/mnist.npz.xz"),
    ("xz of something else", ["run", "-q", *MNIST, "data_dir={in}/not_npz"], "{in}/not_npz/mnist/mnist.npz.xz"),
    ("xz of an npy", ["run", "-q", *MNIST, "data_dir={in}/npy_not_npz"], "{in}/npy_not_npz/mnist/mnist.npz.xz"),
    ("npz without test", ["run", "-q", *MNIST, "data_dir={in}/lacks_test"], "test"),
    ("x and y lengths differ", ["run", "-q", *MNIST, "data_dir={in}/length_mismatch"], "y 150"),
    ("labels beyond the classes", ["run", "-q", *MNIST, "data_dir={in}/labels_out_of_range"], "labels run from 5 to 14"),
    ("float labels", ["run", "-q", *MNIST, "data_dir={in}/float_labels"], "float32"),
    ("images of another shape", ["run", "-q", *MNIST, "data_dir={in}/wrong_shape"], "(20, 20)"),
    ("checksum mismatch", ["run", "-q", *MNIST, "data_dir={in}/checksum"], "SHA256SUMS"),
    ("cache under a file", ["run", "-q", *MNIST, "data_dir={in}/good", "ENV:PFEDKIT_CACHE={in}/afile/cache"],
     "PFEDKIT_CACHE"),
    # compare, reproduce, data stats, report, list
    ("compare unknown algorithm", ["compare", "-q", "--algorithms", "fedavg,fedavgg"], "fedavgg"),
    ("compare an algorithm twice", ["compare", "-q", "--algorithms", "fedavg,fedavg"], "--algorithms"),
    ("compare seeds", ["compare", "-q", "--seeds", "zero"], "--seeds"),
    ("compare --out under a file", ["compare", "-q", "--out", "{in}/afile/cmp", "rounds=1"], "{in}/afile/cmp"),
    ("compare out_dir under a file", ["compare", "-q", "rounds=1", "out_dir={in}/afile/runs"], "{in}/afile"),
    ("reproduce without a paper", ["reproduce"], "paper"),
    ("reproduce unknown paper", ["reproduce", "cwfedav"], "cwfedav"),
    ("reproduce a table that cannot be rebuilt", ["reproduce", "cwfedavg", "--table", "7"], "not an accuracy table"),
    ("reproduce a table whose data is not fetched", ["reproduce", "cwfedavg", "--table", "1-cifar100"],
     "pfedkit data fetch cifar100"),
    ("reproduce unknown table", ["reproduce", "cwfedavg", "--table", "9-mnist"], "9-mnist"),
    ("reproduce --out under a file",
     ["reproduce", "cwfedavg", "--table", "1-mnist", "--budget", "smoke", "--out", "{in}/afile/r"], "{in}/afile/r"),
    ("reproduce out_dir under a file",
     ["reproduce", "cwfedavg", "--table", "1-mnist", "--budget", "smoke", "out_dir={in}/afile/runs"], "{in}/afile/runs"),
    ("data stats --out under a file", ["data", "stats", "--out", "{in}/afile/stats.png"], "{in}/afile/stats.png"),
    ("data stats --out a folder", ["data", "stats", "--out", "{in}/empty"], "{in}/empty"),
    ("data stats bad alpha", ["data", "stats", "partition.alpha=0"], "partition.alpha"),
    ("report a folder that is no run", ["report", "{in}/empty"], "{in}/empty"),
    ("report where report/ is a file", ["report", "COPY:{in}/done/run"], "copied-run/report is a file"),
    ("report unknown option", ["report", "{in}/done/run", "colour=red"], "colour"),
    ("report unparsable option", ["report", "{in}/done/run", "tensorboard=["], "tensorboard=["),
    ("list unknown algorithm", ["list", "fedavgg"], "fedavgg"),
    pytest.param("out_dir read-only", ["run", "-q", "rounds=1", "out_dir=READONLY/runs"], "READONLY",
                 marks=pytest.mark.skipif(WRITES_ANYWHERE, reason="this user writes into read-only folders (root)"),
                 id="out_dir read-only"),
    pytest.param("report read-only", ["report", "READONLY_RUN"], "READONLY_RUN",
                 marks=pytest.mark.skipif(WRITES_ANYWHERE, reason="this user writes into read-only folders (root)"),
                 id="report read-only"),
]


# ---------------------------------------------------------------------------------------------
# Issue 43: damaged or foreign inputs and arithmetic edges (rows kept apart from the table above).
# ---------------------------------------------------------------------------------------------

def _write_damaged_and_foreign_inputs(root: Path) -> None:
    """Inputs of the rows below, beside the fixture's: a finished run's copies with a damaged
    metrics.csv or summary.json, a garbage search space, data directories of garbage or links,
    YAML files a parser can read but no config holds."""
    for name, file, content in [("garbage_metrics", "metrics.csv", b"\x00\x01garbage\xff\n,,,\n\""),
                                ("empty_metrics", "metrics.csv", b""),
                                ("foreign_metrics", "metrics.csv", b"name,colour\nleaf,green\n"),
                                ("latin1_summary", "summary.json", '{"headline": "caf\xe9"}'.encode("latin-1")),
                                ("latin1_config", "config.yaml", "name: caf\xe9\n".encode("latin-1"))]:
        shutil.copytree(root / "done" / "run", root / name)
        (root / name / file).write_bytes(content)
    (root / "garbage_space.yaml").write_bytes(b"\x00\xff\xfe common: [")
    _write_dataset(root / "binary_sums", _npz_bytes(x=np.zeros((4, 28, 28), np.uint8), y=np.arange(4), test=np.ones(4, bool)))
    (root / "binary_sums" / "SHA256SUMS").write_bytes(bytes(range(256)) * 4)
    garbage = np.random.default_rng(1).integers(0, 256, 3000, dtype=np.uint8).tobytes()
    _write_dataset(root / "garbage_files", garbage[:1000], xz=False)
    (root / "garbage_files" / "SHA256SUMS").write_bytes(garbage[1000:1300])
    (root / "garbage_files" / "notes.bin").write_bytes(garbage[1300:])
    (root / "loops").mkdir()
    os.symlink("mnist", root / "loops" / "mnist")  # a link to itself
    os.symlink("b", root / "loops" / "a")
    os.symlink("a", root / "loops" / "b")
    (root / "int_key.yaml").write_text("rounds: 1\n1: 2\n")
    (root / "int_section_key.yaml").write_text("algorithm: fedprox\nfedprox: {1: 2}\n")
    (root / "deep.yaml").write_text("{a: " * 10_000 + "1" + "}" * 10_000 + "\n")
    (root / "surrogate.yaml").write_text('name: "run\\ud800"\n')


DAMAGED_OR_FOREIGN_CASES = [
    # report: what a run directory holds, damaged
    ("report a garbage metrics.csv", ["report", "{in}/garbage_metrics"], "{in}/garbage_metrics/metrics.csv"),
    ("report an empty metrics.csv", ["report", "{in}/empty_metrics"], "{in}/empty_metrics/metrics.csv"),
    ("report a metrics.csv of other columns", ["report", "{in}/foreign_metrics"], "{in}/foreign_metrics/metrics.csv"),
    ("report a summary that is not UTF-8", ["report", "{in}/latin1_summary"], "{in}/latin1_summary/summary.json"),
    ("report a config.yaml that is not UTF-8", ["report", "{in}/latin1_config"], "{in}/latin1_config/config.yaml"),
    # tune, data directories, output folders, Flower
    ("tune a garbage space file", ["tune", "--algorithm", "fedavg", "--trials", "1", "--space", "{in}/garbage_space.yaml"],
     "{in}/garbage_space.yaml"),
    ("binary SHA256SUMS", ["run", "-q", *MNIST, "data_dir={in}/binary_sums"], "{in}/binary_sums/SHA256SUMS"),
    ("data directory of garbage files", ["run", "-q", *MNIST, "data_dir={in}/garbage_files"],
     "{in}/garbage_files/SHA256SUMS"),
    ("dataset folder is a symlink loop", ["run", "-q", *MNIST, "data_dir={in}/loops"], "{in}/loops/mnist"),
    ("data directory is a symlink loop", ["run", "-q", *MNIST, "data_dir={in}/loops/a"], "{in}/loops/a"),
    pytest.param("out_dir in /proc", ["run", "-q", "rounds=1", "out_dir=/proc/runs"], "/proc/runs",
                 marks=pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="no /proc here"),
                 id="out_dir in /proc"),
    ("out_dir under a symlink loop", ["run", "-q", "rounds=1", "out_dir={in}/loops/a/runs"], "{in}/loops/a"),
    ("compare --out under a symlink loop", ["compare", "-q", "--out", "{in}/loops/a/cmp", "rounds=1"], "{in}/loops/a"),
    ("flower app directory is a file", ["flower", "app", "{in}/afile", "rounds=1"], "{in}/afile"),
    # YAML a parser reads but no config holds
    ("YAML with an integer key", ["run", "-q", "{in}/int_key.yaml"], "int_key.yaml"),
    ("YAML with an integer key in a section", ["run", "-q", "{in}/int_section_key.yaml"], "fedprox"),
    ("YAML nested 10,000 levels", ["run", "-q", "{in}/deep.yaml"], "deep.yaml"),
    ("override nested 10,000 levels", ["run", "-q", "partition=" + "[" * 10_000 + "]" * 10_000], "partition="),
    ("name with a lone surrogate", ["run", "-q", "rounds=1", 'name="run\\ud800"'], "name"),
    ("YAML name with a lone surrogate", ["run", "-q", "{in}/surrogate.yaml"], "name"),
    # arithmetic edges
    ("lr beyond float32", ["run", "-q", "rounds=1", "lr=1e308", "weight_decay=0.1"], "lr"),
    ("weight decay beyond float32", ["run", "-q", "rounds=1", "weight_decay=1e300"], "weight_decay"),
    ("pfedme beta beyond float32", ["run", "-q", "rounds=1", "algorithm=pfedme", "pfedme.beta=1e308"], "pfedme.beta"),
    ("pfedme beta cancelling the mix", ["run", "-q", "rounds=1", "algorithm=pfedme", "pfedme.beta=1e20"],
     "pfedme.beta"),
    ("dp target no round can meet",
     ["run", "-q", "rounds=2", "num_clients=3", "dp.level=client", "dp.target_epsilon=1e-6"], "dp.target_epsilon"),
    ("fasttext on image-free features", ["run", "-q", "rounds=1", "model=fasttext"], "fasttext"),
    ("fasttext on images", ["run", "-q", *MNIST, "model=fasttext", "data_dir={in}/good"], "fasttext"),
]
CASES += DAMAGED_OR_FOREIGN_CASES


@pytest.mark.parametrize("run", ["garbage_metrics", "empty_metrics", "foreign_metrics", "latin1_summary",
                                 "latin1_config"])
def test_a_damaged_run_directory_gets_no_half_written_report(run, inputs, capsys):
    assert main(["report", str(inputs / run)]) == 2
    assert not (inputs / run / "report").exists()


def test_reproduce_list_without_a_data_directory_says_how_to_give_one(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("PFEDKIT_DATA", raising=False)
    assert main(["reproduce", "dapfl", "--list"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "femnist missing" in line)
    assert "pfedkit data fetch femnist --data-dir DIR" in line and "data_dir=DIR" in line and "PFEDKIT_DATA" in line
    monkeypatch.setenv("PFEDKIT_DATA", str(tmp_path))  # a data directory: the fetch command needs nothing more
    assert main(["reproduce", "dapfl", "--list"]) == 0
    assert "femnist missing -> pfedkit data fetch femnist\n" in capsys.readouterr().out


def _case_id(case) -> str:
    return case.id if hasattr(case, "id") else case[0]


def _prepare_argv(argv: list[str], inputs: Path, tmp_path: Path, monkeypatch) -> list[str]:
    """Fill in the placeholders; `ENV:K=V` sets an environment variable, `COPY:DIR` copies a run
    and puts a file where its report/ folder goes, READONLY(_RUN) are read-only folders."""
    prepared = []
    for item in argv:
        item = item.replace("{in}", str(inputs))
        if item.startswith("ENV:"):
            key, value = item[4:].split("=", 1)
            monkeypatch.setenv(key, value)
            continue
        if item.startswith("COPY:"):
            copy = shutil.copytree(item[5:], tmp_path / "copied-run")
            (copy / "report").write_text("a file where the report folder goes")
            item = str(copy)
        if "READONLY_RUN" in item:
            copy = shutil.copytree(inputs / "done" / "run", tmp_path / "READONLY_RUN")
            copy.chmod(0o555)
            item = str(copy)
        elif "READONLY" in item:
            (tmp_path / "READONLY").mkdir(mode=0o555)
            item = item.replace("READONLY", str(tmp_path / "READONLY"))
        prepared.append(item)
    return prepared


def _leftovers(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


@pytest.mark.parametrize("name,argv,culprit", [c if hasattr(c, "id") else pytest.param(*c, id=c[0]) for c in CASES])
def test_bad_input_is_one_line_exit_2_naming_the_culprit_and_leaves_nothing(
        name, argv, culprit, inputs, tmp_path, monkeypatch, capsys):
    cwd, cache = tmp_path / "cwd", tmp_path / "cache"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("PFEDKIT_CACHE", str(cache))
    monkeypatch.delenv("PFEDKIT_DATA", raising=False)
    argv = _prepare_argv(argv, inputs, tmp_path, monkeypatch)
    out = tmp_path / "runs"
    if argv[0] in ("run", "compare", "data") and not any(a.startswith(("out_dir=", "--resume")) for a in argv):
        argv.append(f"out_dir={out}")

    status = main(argv)

    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert culprit.replace("{in}", str(inputs)) in err
    assert "<unicode string>" not in err and "num_classes" not in err  # no name the user never wrote
    assert _leftovers(out) == [] and _leftovers(cwd) == [] and _leftovers(cache) == []


def test_the_table_covers_at_least_forty_bad_inputs():
    assert len(CASES) >= 40


# ---------------------------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,suggestion", [
    (["run", "-q", "lrr=0.1"], "did you mean lr?"),
    (["run", "-q", "partition.alpah=0.1"], "did you mean alpha?"),
    (["run", "-q", "headline.pointt=best"], "did you mean point?"),
    (["run", "-q", "algorithm=fedprox", "fedprox.muu=1"], "did you mean mu?"),
    (["run", "-q", "fedprx.mu=1"], "did you mean fedprox?"),
    (["run", "-q", "algorithm=fedavgg"], "did you mean fedavg?"),
    (["run", "-q", "dataset=fashion_mnst"], "did you mean fashion_mnist?"),
    (["run", "-q", "model=resnet81"], "did you mean resnet18?"),
    (["run", "-q", "preset=pfllb"], "did you mean pfllib?"),
    (["list", "dito"], "did you mean ditto?"),
    (["compare", "--algorithms", "local,fedprx"], "did you mean fedprox?"),
    (["reproduce", "fedrem"], "did you mean fedrema?"),
    (["reproduce", "cwfedavg", "--table", "1-mnsit"], "did you mean 1-mnist?"),
])
def test_misspelt_names_get_a_suggestion(argv, suggestion, tmp_path, capsys):
    assert main(argv + ([f"out_dir={tmp_path}"] if argv[0] == "run" else [])) == 2
    assert suggestion in capsys.readouterr().err


def test_no_suggestion_for_a_name_like_nothing(capsys):
    assert main(["run", "-q", "zzzz=1"]) == 2
    assert "did you mean" not in capsys.readouterr().err


def test_yaml_error_names_the_file_and_line(inputs, capsys):
    assert main(["run", "-q", str(inputs / "bad.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"config file {inputs / 'bad.yaml'}" in err and "line 2" in err


def test_data_errors_name_absolute_paths(inputs, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PFEDKIT_CACHE", str(tmp_path / "cache"))
    relative = os.path.relpath(inputs / "length_mismatch", tmp_path)
    assert main(["run", "-q", *MNIST, f"data_dir={relative}", f"out_dir={tmp_path / 'runs'}"]) == 2
    assert str(inputs / "length_mismatch" / "mnist" / "mnist.npz.xz") in capsys.readouterr().err


def test_a_bad_cached_file_is_decoded_again_not_trusted(inputs, tmp_path, monkeypatch):
    """A cache entry that does not read (an older version cached a bad file) is replaced."""
    from pfedkit.data import datasets

    cache = tmp_path / "cache"
    monkeypatch.setenv("PFEDKIT_CACHE", str(cache))
    datasets._LOADED.clear()
    first = datasets.load_dataset("mnist", str(inputs / "good"))
    [cached] = cache.iterdir()
    cached.write_bytes(b"damaged")
    datasets._LOADED.clear()
    again = datasets.load_dataset("mnist", str(inputs / "good"))
    assert np.array_equal(first.y, again.y) and np.load(cached)["x"].shape == (200, 28, 28)
    datasets._LOADED.clear()


# ---------------------------------------------------------------------------------------------
# Accepted, but not as written: one warning line, and config.yaml records what is in effect
# ---------------------------------------------------------------------------------------------

def _tiny_run(tmp_path: Path, *overrides: str) -> list[str]:
    return ["run", "-q", "rounds=1", "num_clients=3", f"out_dir={tmp_path}", "name=run", *overrides]


def test_options_of_an_algorithm_not_running_warn_and_stay_out_of_config_yaml(tmp_path, capsys):
    assert main(_tiny_run(tmp_path, "algorithm=fedavg", "fedprox.mu=0.1")) == 0
    warnings_printed = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings_printed) == 1 and "fedprox.mu=0.1" in warnings_printed[0]
    recorded = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert "fedprox" not in recorded and recorded["fedavg"] == {}
    assert recorded["model"] == "mlp"  # the model that ran, not `auto`


def test_options_of_the_running_algorithm_do_not_warn(tmp_path, capsys):
    assert main(_tiny_run(tmp_path, "algorithm=fedprox", "fedprox.mu=0.1")) == 0
    assert "warning:" not in capsys.readouterr().err
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["fedprox"] == {"mu": 0.1}


def test_inactive_options_must_still_be_valid():
    with pytest.raises(Exception, match="fedprox.mu"):
        load_config(None, ["fedprox.mu=-1"])


def test_compare_warns_only_about_algorithms_it_does_not_compare():
    with pytest.warns(ConfigWarning, match="ditto.lam=2"):
        config = load_config(None, ["fedprox.mu=0.1", "ditto.lam=2"], expected_sections=["fedavg", "fedprox"])
    assert "ditto" not in config.to_dict() and "fedprox" not in config.to_dict()


def test_resolved_model_for_an_image_dataset():
    assert load_config(None, ["dataset=mnist"]).model == "cnn"
    assert load_config(None, ["dataset=mnist", "model=alexnet"]).model == "alexnet"


def test_fedfomo_says_how_many_peers_it_uses(tmp_path, capsys):
    assert main(_tiny_run(tmp_path, "algorithm=fedfomo", "fedfomo.num_peers=50")) == 0
    err = capsys.readouterr().err
    assert re.search(r"^warning: fedfomo.num_peers=50: .* 2 peer models", err, re.M), err


# ---------------------------------------------------------------------------------------------
# Small things a user meets first
# ---------------------------------------------------------------------------------------------

def test_reproduce_list_without_a_paper_lists_every_paper_and_table(capsys):
    assert main(["reproduce", "--list"]) == 0
    out = capsys.readouterr().out
    for paper in PAPERS:
        assert re.search(rf"^{paper}: ", out, re.M)
    assert "--table 1-mnist" in out and "--table 2-cifar10" in out
    # tables on fetchable data (CIFAR-100, Tiny-ImageNet, AG News) are ordinary tables now; what is
    # left unrebuilt is not an accuracy table
    assert "--table 1-cifar100" in out and "--table 6: " in out and "(not rebuilt) 1-cifar100" not in out
    assert re.search(r"\(not rebuilt\) 7: not an accuracy table", out)


def test_version(capsys):
    from pfedkit import __version__

    with pytest.raises(SystemExit) as stopped:
        main(["--version"])
    assert stopped.value.code == 0 and capsys.readouterr().out.strip() == f"pfedkit {__version__}"


def _subparser(name: str):
    action = next(a for a in build_parser()._subparsers._group_actions if a.dest == "command")
    return action.choices[name]


def test_every_bench_flag_has_help():
    options = [a for a in _subparser("bench")._actions if a.option_strings and a.dest != "help"]
    assert len(options) >= 10
    assert [a.dest for a in options if not a.help] == []


def test_compare_help_names_its_default_algorithms():
    from pfedkit.cli import DEFAULT_COMPARE

    assert f"default: {DEFAULT_COMPARE}" in " ".join(_subparser("compare").format_help().split())


def test_list_columns_are_aligned(capsys):
    assert main(["list"]) == 0
    rows = re.findall(r"^(  \S+ +)\S", capsys.readouterr().out, re.M)  # name, then its description
    assert len(rows) > 50 and len({len(row) for row in rows}) == 1
