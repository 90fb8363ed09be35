"""Start-up: commands that only read names (list, config, reproduce --list, --help) and config
errors answer without importing torch, pandas, matplotlib, scikit-learn or SciPy, through the
catalog of algorithms and models (pfedkit/catalog.py), which must match the classes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pfedkit import catalog as catalog_module
from pfedkit.catalog import CATALOG_FILE, build_catalog, catalog, catalog_json

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "pandas", "matplotlib", "sklearn", "scipy")

# Each answers from names alone: a listing, or a config refused before anything runs.
LIGHT_COMMANDS = [
    ["--help"],
    ["list"],
    ["list", "fedprox"],
    ["config"],
    ["reproduce", "--list"],
    ["reproduce", "dapfl", "--list"],
    ["run", "lrr=0.1"],
    ["run", "algorithm=fedprox", "fedprox.muu=1"],
    ["run", "algorithm=fedavgg"],
    ["run", "model=fasttext"],
    ["run", "dataset=mnistt"],
    ["compare", "--algorithms", "fedavg,fedprx"],
    ["tune", "--algorithm", "fedavg", "--trials", "1", "partition.alpah=1"],
    ["data", "stats", "partition.alpha=0"],
]


def test_catalog_json_is_what_the_classes_say():
    """Fails after an algorithm or model changed (or was added) without `python -m pfedkit.catalog`."""
    stored = json.loads(CATALOG_FILE.read_text())
    assert stored == json.loads(catalog_json(build_catalog())), "catalog.json is stale: run python -m pfedkit.catalog"


def test_a_stale_catalog_is_not_used(monkeypatch, tmp_path):
    """catalog.json made from other sources (here: one naming an algorithm that does not exist) is
    ignored: the catalog comes from the classes."""
    stale = json.loads(CATALOG_FILE.read_text())
    stale["sources"] = "digest of older sources"
    stale["algorithms"]["ghost"] = stale["algorithms"]["fedavg"]
    fake = tmp_path / "catalog.json"
    fake.write_text(json.dumps(stale))
    monkeypatch.setattr(catalog_module, "CATALOG_FILE", fake)
    catalog.cache_clear()
    try:
        assert "ghost" not in catalog().algorithms and catalog() == build_catalog()
    finally:
        catalog.cache_clear()


def test_the_catalog_names_what_validation_needs():
    built = catalog()
    assert built.algorithms["fedprox"].options["mu"].default == "0.01"
    assert built.algorithms["fedproto"].heterogeneous_models and not built.algorithms["fedavg"].heterogeneous_models
    assert [name for name, model in built.models.items() if model.token_ids] == ["fasttext"]


def test_commands_answering_from_names_import_nothing_heavy(tmp_path):
    """All LIGHT_COMMANDS in one fresh interpreter, then the heavy modules it imported."""
    script = (f"import sys\nfrom pfedkit.cli import main\nfor argv in {LIGHT_COMMANDS!r}:\n"
              "    try:\n        main(argv + (['out_dir=unused'] if argv[0] in ('run', 'data') else []))\n"
              "    except SystemExit:\n        pass\n"
              f"print(sorted(name for name in {HEAVY!r} if name in sys.modules), file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "[]", done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "unused").exists()


@pytest.mark.parametrize("argv,message", [
    (["run", "lrr=0.1"], "did you mean lr?"),
    (["run", "algorithm=fedprox", "fedprox.muu=1"], "fedprox.muu: unknown key (did you mean mu?); allowed: mu"),
    (["run", "model=fasttext"], "model: fasttext cannot read digits"),
])
def test_the_early_checks_say_what_the_full_validation_said(argv, message, capsys):
    from pfedkit.cli import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err
