"""The data package's shape (issue 23): it imports nothing above it and has no import circles, one
table (DATASETS) says what a dataset is, and `data fetch`'s sources agree with that table."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import pfedkit.data
from pfedkit.data import datasets
from pfedkit.data.datasets import DATASETS, LOADERS, default_model, load_dataset
from pfedkit.data.fetch import KINDS
from pfedkit.data.sources import SOURCES, fetchable
from pfedkit.data.store import encode_xz
from pfedkit.models import model_names

DATA = Path(pfedkit.data.__file__).parent
# What pfedkit/data/ may import: the floors below it (docs/architecture.md) and itself.
BELOW = ("pfedkit.core", "pfedkit.atomic", "pfedkit.models", "pfedkit.evaluation", "pfedkit.data")


def _pfedkit_imports(path: Path) -> list[str]:
    """Every pfedkit module `path` imports, at module level or inside functions."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pfedkit"):
            found += [node.module] if node.module != "pfedkit.data" else [f"pfedkit.data.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("pfedkit")]
    return found


def test_the_data_package_imports_nothing_above_it():
    above = {f"{path.name} -> {module}" for path in DATA.glob("*.py") for module in _pfedkit_imports(path)
             if not module.startswith(BELOW)}
    assert not above, f"pfedkit/data/ imports from above its floor: {sorted(above)}"


def test_the_data_modules_import_each_other_without_a_circle():
    edges = {path.stem: {module.split(".")[2] for module in _pfedkit_imports(path)
                         if module.startswith("pfedkit.data.")} - {path.stem}
             for path in DATA.glob("*.py")}
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import circle: {' -> '.join(path[path.index(module):] + (module,))}"
        if module not in done:
            for target in edges.get(module, ()):
                visit(target, path + (module,))
            done.add(module)

    for module in edges:
        visit(module, ())


def test_every_dataset_row_names_a_model_and_a_loadable_kind():
    for name, info in DATASETS.items():
        assert info.name == name
        assert default_model(name) == info.model and info.model in model_names(), name
        assert info.embedded or info.kind in LOADERS, f"{name}: no loader for kind {info.kind}"
        assert info.source is None or DATASETS[info.source].source is None  # a subset of a file, not of a subset
    assert default_model("hf:someone/images") == "cnn"
    with pytest.raises(ValueError, match="known datasets"):
        default_model("imagenet")


def test_every_fetch_source_is_a_dataset_file_that_fetch_can_write():
    assert fetchable() == list(SOURCES)
    for name in SOURCES:
        info = DATASETS[name]  # a source without its table row could not be checked or loaded
        assert info.source is None and not info.embedded, name
        assert info.kind in KINDS, f"{name}: data fetch cannot write kind {info.kind}"
    # every file a dataset reads can be fetched (the shared copies of mnist etc. can be, too)
    assert {info.file_name for info in DATASETS.values() if not info.embedded} <= set(SOURCES)


def _write_mnist_like(root: Path, labels: np.ndarray) -> None:
    folder = root / "mnist"
    folder.mkdir(parents=True, exist_ok=True)
    x = np.zeros((len(labels), 28, 28), np.uint8)
    (folder / "mnist.npz.xz").write_bytes(encode_xz({"x": x, "y": labels, "test": np.zeros(len(labels), bool)}))


def test_a_dataset_file_written_again_is_read_again_in_the_same_process(tmp_path, monkeypatch):
    """Datasets stay in memory between the runs of one process; a file replaced meanwhile (fetched
    again, edited) must not be served from memory."""
    monkeypatch.setattr(datasets, "_LOADED", {})
    root, cache = tmp_path / "data", str(tmp_path / "cache")
    _write_mnist_like(root, np.arange(20, dtype=np.uint8) % 10)
    first = load_dataset("mnist", str(root), cache_dir=cache)
    assert load_dataset("mnist", str(root), cache_dir=cache) is first  # unchanged: held, not decoded again
    _write_mnist_like(root, np.arange(30, dtype=np.uint8) % 3)
    again = load_dataset("mnist", str(root), cache_dir=cache)
    assert np.array_equal(again.y, np.arange(30) % 3)
