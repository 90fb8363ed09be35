"""Each method's figures are found by name in pfedkit/report/methods/ (algorithms only record).

The lookup walks the algorithm class's MRO, so a subclass in another module draws its parent's
figures; an algorithm without a drawing module draws nothing; every drawing module belongs to an
algorithm module (no orphan), and every method that has one draws its figures from a real run;
no algorithm (or data) module imports the report package. Which methods draw is found from the
code, never listed: a method's figures are its one file in report/methods/.
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
from conftest import quick_options

import pfedkit
from pfedkit.algorithms import algorithm_names, get_algorithm
from pfedkit.algorithms.pfedpm import PFedPM
from pfedkit.report.methods import ALGORITHMS_PACKAGE, draw_diagnostics, drawing_module_name
from pfedkit.run_files import read_diagnostics

PACKAGE = Path(pfedkit.__file__).parent
METHODS = PACKAGE / "report" / "methods"
# the methods that draw figures: those whose class (or a parent) has a drawing module
WITH_FIGURES = [name for name in algorithm_names() if drawing_module_name(get_algorithm(name)) is not None]


def digits_diagnostics(algorithm: str, tmp_path: Path) -> dict:
    result = pfedkit.run({"algorithm": algorithm, "dataset": "digits", "num_clients": 4, "rounds": 2,
                          "threads": 1, "seed": 1, "out_dir": str(tmp_path / "runs"), **quick_options(algorithm)})
    return read_diagnostics(result.run_dir / "diagnostics.pt")


@pytest.fixture(scope="module")
def rpfedpm_diagnostics(tmp_path_factory):
    return digits_diagnostics("rpfedpm", tmp_path_factory.mktemp("rpfedpm"))


def algorithm_modules() -> set[str]:
    """The modules of pfedkit/algorithms/ that define a registered algorithm or one of its parents."""
    return {klass.__module__.removeprefix(ALGORITHMS_PACKAGE) for name in algorithm_names()
            for klass in get_algorithm(name).__mro__ if klass.__module__.startswith(ALGORITHMS_PACKAGE)}


def test_drawing_modules_are_those_of_algorithm_modules_and_draw():
    """report/methods/M.py draws (has `draw`) exactly when pfedkit/algorithms/M.py defines an
    algorithm: no drawing that no method reaches (an orphan, e.g. left behind by a renamed method),
    and no module the lookup finds that cannot draw. Other modules there are helpers (shared.py)."""
    owners = algorithm_modules()
    modules = sorted(path.stem for path in METHODS.glob("*.py") if path.stem != "__init__")
    draws = {name: callable(getattr(importlib.import_module(f"pfedkit.report.methods.{name}"), "draw", None))
             for name in modules}
    assert {name for name, has_draw in draws.items() if has_draw and name not in owners} == set(), "orphans"
    assert {name for name, has_draw in draws.items() if not has_draw and name in owners} == set(), "cannot draw"
    assert WITH_FIGURES  # the lookup finds them


@pytest.mark.parametrize("algorithm", WITH_FIGURES)
def test_a_real_runs_diagnostics_are_drawn(algorithm, tmp_path, rpfedpm_diagnostics):
    diagnostics = rpfedpm_diagnostics if algorithm == "rpfedpm" else digits_diagnostics(algorithm, tmp_path)
    written = draw_diagnostics(get_algorithm(algorithm), diagnostics, tmp_path / "report")
    assert written, f"{algorithm}: nothing drawn"
    for path in written:
        assert path.parent == tmp_path / "report" and path.suffix == ".png"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_subclass_in_another_module_draws_its_parents_figures(rpfedpm_diagnostics, tmp_path):
    # a new algorithm module subclassing pFedPM, with no drawing module of its own: the MRO walk
    # must reach report/methods/pfedpm.py
    child = type("Child", (PFedPM,), {"__module__": "pfedkit.algorithms.not_a_drawing_module"})
    assert drawing_module_name(child) == "pfedkit.report.methods.pfedpm"
    written = draw_diagnostics(child, rpfedpm_diagnostics, tmp_path / "child")
    parent = draw_diagnostics(PFedPM, rpfedpm_diagnostics, tmp_path / "parent")
    assert [p.name for p in written] == [p.name for p in parent] == [
        "pfedpm_feature_distance_clients.png", "pfedpm_feature_distance.png"]


def test_an_algorithm_without_a_drawing_module_draws_nothing(small_config, rpfedpm_diagnostics, tmp_path):
    result = pfedkit.run(small_config)  # fedavg
    recorded = result.run_dir / "diagnostics.pt"
    own = read_diagnostics(recorded) if recorded.is_file() else {}
    # with diagnostics another method would draw, too: the lookup, not the data, decides
    diagnostics = {**rpfedpm_diagnostics, **own}
    assert draw_diagnostics(get_algorithm("fedavg"), diagnostics, tmp_path / "report") == []
    assert not (tmp_path / "report").exists()


def imported_modules(path: Path) -> set[str]:
    """Absolute names of every module `path` imports (module level and inside functions)."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module) if part)
            names |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return names


@pytest.mark.parametrize("package", ["algorithms", "data", "core"])
def test_lower_floors_import_nothing_from_report(package):
    offenders = {str(path.relative_to(PACKAGE)): sorted(name for name in imported_modules(path)
                                                        if name == "pfedkit.report"
                                                        or name.startswith("pfedkit.report."))
                 for path in sorted((PACKAGE / package).rglob("*.py"))}
    assert {path: names for path, names in offenders.items() if names} == {}
