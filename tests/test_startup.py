"""Start-up: commands that only read names (list, config, reproduce --list, --help) and config
errors answer without importing torch, pandas, matplotlib, scikit-learn or SciPy, through the
catalog of algorithms and models (pfedkit/catalog.py): cached per version of the sources, always
what the classes say, and live where algorithms or models are registered at run time."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pfedkit import catalog as catalog_module
from pfedkit.catalog import build_catalog, cache_file, catalog, catalog_json

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


def _cached_catalog(cache: Path) -> catalog_module.Catalog:
    """The catalog as a fresh interpreter (no algorithm imported) reads it, with cache `cache`."""
    done = subprocess.run([sys.executable, "-c", "import sys, json, dataclasses\nfrom pfedkit.catalog import catalog\n"
                           "print(json.dumps(dataclasses.asdict(catalog())))\n"
                           "print('torch' in sys.modules, file=sys.stderr)"],
                          capture_output=True, text=True, timeout=300, check=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "PFEDKIT_CACHE": str(cache)})
    return catalog_module._from_dict(json.loads(done.stdout)), done.stderr.strip() == "True"


def test_the_cached_catalog_is_what_the_classes_say_and_is_read_without_torch(tmp_path):
    first, imported = _cached_catalog(tmp_path)
    assert imported and cache_file().name in [p.name for p in tmp_path.iterdir()]  # built from the classes once
    second, imported_again = _cached_catalog(tmp_path)
    assert not imported_again  # then read from the cache
    assert first == second == build_catalog()


def test_a_cache_of_other_sources_is_not_read(monkeypatch, tmp_path):
    """Each version of the sources has its own file: an edit (a new digest) never reads an old one."""
    stale = json.loads(catalog_json(build_catalog()))
    stale["algorithms"]["ghost"] = stale["algorithms"]["fedavg"]
    (tmp_path / cache_file("0" * 64).name).write_text(json.dumps(stale))
    ghost_free, _ = _cached_catalog(tmp_path)
    assert "ghost" not in ghost_free.algorithms
    (tmp_path / _current_cache_name()).write_text(json.dumps(stale))  # the current digest's file is read as is
    with_ghost, imported = _cached_catalog(tmp_path)
    assert "ghost" in with_ghost.algorithms and not imported


def _current_cache_name() -> str:
    return cache_file().name


def test_an_algorithm_registered_at_run_time_is_known_to_the_catalog():
    """A process that registered its own method (a user's script, a test probe) validates it."""
    from pfedkit.algorithms.fedavg import FedAvg
    from pfedkit.algorithms.registry import registry

    class Probe(FedAvg):
        name = "startup_probe"

    registry()[Probe.name] = Probe
    try:
        assert "startup_probe" in catalog().algorithms
        from pfedkit.config import load_config

        assert load_config({"algorithm": "startup_probe"}).algorithm == "startup_probe"
    finally:
        del registry()[Probe.name]


def test_a_removed_option_is_refused_with_its_reason_without_torch(tmp_path):
    script = ("import sys\nfrom pfedkit.cli import main\nmain(['run', 'algorithm=rpfedpm', 'rpfedpm.relation_lr=0.1', "
              "'out_dir=unused'])\nprint('torch' in sys.modules, file=sys.stderr)\n")
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "PFEDKIT_CACHE": str(tmp_path)}
    subprocess.run([sys.executable, "-c", "from pfedkit.catalog import catalog; catalog()"], env=env, check=True)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert "rpfedpm.relation_lr: relation_lr was removed" in done.stderr and "batch_size" in done.stderr
    assert done.stderr.strip().splitlines()[-1] == "False"


def test_the_catalog_names_what_validation_needs():
    built = catalog()
    assert built.algorithms["fedprox"].options["mu"].default == "0.01"
    assert built.algorithms["fedproto"].heterogeneous_models and not built.algorithms["fedavg"].heterogeneous_models
    assert [name for name, model in built.models.items() if model.token_ids] == ["fasttext"]


def test_commands_answering_from_names_import_nothing_heavy(tmp_path):
    """All LIGHT_COMMANDS in one fresh interpreter, then the heavy modules it imported."""
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    subprocess.run([sys.executable, "-c", "from pfedkit.catalog import catalog; catalog()"], env=env, check=True)
    script = (f"import sys\nfrom pfedkit.cli import main\nfor argv in {LIGHT_COMMANDS!r}:\n"
              "    try:\n        main(argv + (['out_dir=unused'] if argv[0] in ('run', 'data') else []))\n"
              "    except SystemExit:\n        pass\n"
              f"print(sorted(name for name in {HEAVY!r} if name in sys.modules), file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=env)
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
