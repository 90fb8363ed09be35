"""A new method is one file (issue 44): written into a copy of the package, with nothing else
changed, it is registered, and every generic test runs on it and passes.

The copy holds pfedkit/, tests/, pyproject.toml (the pytest settings) and the fingerprint script;
ONE file is added, pfedkit/algorithms/oneoffhead.py: FedPer with a proximal pull on the private
head, declaring what a method declares (name, description, options with a search range, its
evaluated model). A pytest process on the copy (PYTHONPATH: the copy) then runs the generic tests
selected by the method's name: every backend, the evaluated model, resume, new clients, client-
level DP, the search space; plus the checks over all methods that do not take a name (every
drawing module belongs to an algorithm, `pfedkit list` shows every option), and the fingerprint
script runs it. About 30 s (a third of it the inner pytest's start), so not marked slow.
"""
from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pfedkit

REPO = Path(pfedkit.__file__).resolve().parents[1]
NAME = "oneoffhead"
METHOD_FILE = f"pfedkit/algorithms/{NAME}.py"
METHOD_SOURCE = '''"""One-off method written by tests/test_one_file_method.py into a copy of the package: the server
averages the bodies; each client keeps its head, trained with a pull mu/2 ||h - h_start||^2 towards
the head it started the round with. Evaluated: global body + own head."""
from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
from pydantic import Field

from pfedkit.algorithms.registry import register
from pfedkit.core.aggregation import MeanOfUploads
from pfedkit.core.contract import Algorithm, ClientData, ClientUpdate, Fit, Forward, HyperParams, Message, cross_entropy
from pfedkit.core.params import Params, merge, select
from pfedkit.core.search import float_range


def anchored_head_loss(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any], *,
                       mu: float) -> torch.Tensor:
    """CE + mu/2 sum over the head's tensors of ||h - anchor||^2."""
    anchor = context["head_anchor"]
    pull = sum(((params[name] - anchor[name]) ** 2).sum() for name in anchor)
    return cross_entropy(out, y, params, context) + 0.5 * mu * pull


@register
class OneOffHead(MeanOfUploads, Algorithm):
    name = "oneoffhead"
    description = "one-off test method: FedAvg on the body, private heads pulled to their round start"
    evaluated_model = "shared_body"
    averaged = "body"

    class Hyper(HyperParams):
        mu: float = Field(0.1, ge=0, description="pull of the head towards its value at the round's start",
                          json_schema_extra=float_range(0.01, 1.0, log=True))

    def init_server(self, params: Params) -> dict[str, Any]:
        return {"body": select(params, "body")}

    def init_client(self, cid: int, params: Params) -> dict[str, Any]:
        return {"head": select(params, "head")}

    def broadcast(self, rnd: int, server: dict, cids: list[int]) -> dict[int, Message]:
        return {cid: {"body": server["body"]} for cid in cids}

    def client_update(self, rnd: int, cid: int, client: dict, message: Message, data: ClientData) -> ClientUpdate:
        loss = partial(anchored_head_loss, mu=self.hyper.mu)
        params = yield Fit(merge(message["body"], client["head"]), loss=loss, context={"head_anchor": client["head"]})
        return {"head": select(params, "head")}, {"params": select(params, "body"), "weight": data.n_train}

    def client_model(self, cid: int, server: dict, client: dict) -> Params:
        return merge(server["body"], client["head"])
'''
# The generic tests a method must pass, each parametrised over the registry: (file, test).
BY_NAME = [
    ("tests/test_backends.py", "test_every_backend_gives_the_sequential_numbers"),
    ("tests/test_evaluated_model.py", "test_every_algorithm_evaluates_the_downloaded_and_trained_parts"),
    ("tests/test_client_states.py", "test_every_algorithm_resumed_after_a_crash_ends_as_uninterrupted"),
    ("tests/test_new_clients.py", "test_every_algorithm_supports_new_clients_or_refuses_in_one_line"),
    ("tests/test_privacy.py", "test_client_dp_attaches_or_refuses_in_one_line"),
    ("tests/test_tuning.py", "test_the_shipped_space_is_lr_and_the_ranges_declared_on_the_algorithm_s_options"),
]
# Checks over every method at once (no parameter to select by name).
OVER_ALL = [
    ("tests/test_report_methods.py", "test_drawing_modules_are_those_of_algorithm_modules_and_draw"),
    ("tests/test_config.py", "test_list_shows_every_algorithms_options_with_defaults"),
]


def copy_of_the_project(root: Path) -> None:
    """What the generic tests need of this checkout, without caches."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("pfedkit", "tests"):
        shutil.copytree(REPO / folder, root / folder, ignore=ignore)
    (root / "benchmarks").mkdir()
    for name in ("pyproject.toml", "benchmarks/metrics_fingerprint.py"):
        shutil.copy2(REPO / name, root / name)


def changed_files(left: Path, right: Path) -> list[str]:
    """Files added, removed or changed between two trees (relative paths, caches left out)."""
    comparison = filecmp.dircmp(left, right, ignore=["__pycache__"])
    changed = comparison.left_only + comparison.right_only + comparison.diff_files + comparison.funny_files
    for name, sub in comparison.subdirs.items():
        changed += [f"{name}/{path}" for path in changed_files(left / name, right / name)]
    return sorted(changed)


def outcomes(report: Path) -> dict[tuple[str, str], str]:
    """{(test file, test id): passed | failed | error | skipped} from a JUnit XML report."""
    results = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        file = case.get("classname").replace(".", "/") + ".py"
        results[file, case.get("name")] = {"failure": "failed"}.get(kinds[0], kinds[0]) if kinds else "passed"
    return results


def test_a_new_method_is_one_file_and_every_generic_test_runs_on_it(tmp_path):
    root = tmp_path / "project"
    copy_of_the_project(root)
    (root / METHOD_FILE).write_text(METHOD_SOURCE)
    assert changed_files(REPO / "pfedkit", root / "pfedkit") == [METHOD_FILE.removeprefix("pfedkit/")]
    assert changed_files(REPO / "tests", root / "tests") == []

    env = {**os.environ, "PYTHONPATH": str(root)}
    selection = " or ".join([NAME] + [test for _, test in OVER_ALL])
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'inner'}",
         f"--junitxml={tmp_path / 'report.xml'}", "-k", selection, *sorted({file for file, _ in BY_NAME + OVER_ALL})],
        cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    results = outcomes(tmp_path / "report.xml")
    expected = {(file, f"{test}[{NAME}]") for file, test in BY_NAME} | set(OVER_ALL)
    assert {key: results.get(key, "not collected") for key in expected} == {key: "passed" for key in expected}
    assert set(results.values()) == {"passed"}

    fingerprint = subprocess.run([sys.executable, "benchmarks/metrics_fingerprint.py", str(tmp_path / "prints"),
                                  "sequential", NAME], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert f"{NAME} ok" in fingerprint.stdout, fingerprint.stdout + fingerprint.stderr[-2000:]
    assert (tmp_path / "prints" / f"{NAME}.csv").is_file()
