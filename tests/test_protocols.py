"""Every runtime and both clients' sides satisfy the round loop's Protocols (engine/protocols.py)
method by method, parameter by parameter (`isinstance` with runtime_checkable only checks that
the names exist); the backend table, the config and the command line name the same backends."""
from __future__ import annotations

import ast
import inspect
import textwrap
import typing
from typing import Protocol

import pytest

from pfedkit import build
from pfedkit.config import Config, load_config
from pfedkit.core.backends import BACKENDS
from pfedkit.core.errors import ConfigError
from pfedkit.engine.protocols import Clients, EvaluatesNewClients, Runtime
from pfedkit.engine.runtimes.processes import ProcessRuntime
from pfedkit.engine.runtimes.ray import RayRuntime  # imports Ray only when a RayRuntime is made
from pfedkit.engine.runtimes.sequential import SequentialRuntime
from pfedkit.engine.runtimes.vectorized import VectorizedRuntime
from pfedkit.engine.local_clients import LocalClients

RUNTIME_CLASSES = {"sequential": SequentialRuntime, "processes": ProcessRuntime,
                   "vectorized": VectorizedRuntime, "ray": RayRuntime}


def protocol_methods(protocol: type) -> list[str]:
    return [name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")]


def assigned_attributes(cls: type) -> set[str]:
    """Class attributes and every `self.X = ...` target in the class's methods (the attributes an
    instance has, read without building one: a ProcessRuntime forks, a RayRuntime starts Ray)."""
    names = {name for klass in cls.__mro__ for name in vars(klass)}
    trees = [ast.parse(textwrap.dedent(inspect.getsource(klass))) for klass in cls.__mro__ if klass is not object]
    for node in (node for tree in trees for node in ast.walk(tree)):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        for target in targets:
            for leaf in ast.walk(target):
                if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self":
                    names.add(leaf.attr)
    return names


def signature_problems(method_name: str, wanted: inspect.Signature, actual: inspect.Signature) -> list[str]:
    """Why `actual` cannot be called as `wanted` is: each of the protocol's parameters must be there,
    in the same place, with the same name and kind; any extra parameter must be optional."""
    wanted_params = list(wanted.parameters.values())[1:]  # without self
    actual_params = list(actual.parameters.values())[1:]
    problems = []
    for i, param in enumerate(wanted_params):
        have = actual_params[i] if i < len(actual_params) else None
        if have is None or (have.name, have.kind) != (param.name, param.kind):
            problems.append(f"{method_name}: parameter {i + 1} should be {param.name} ({param.kind.description}), "
                            f"found {have.name + ' (' + have.kind.description + ')' if have else 'nothing'}")
    for extra in actual_params[len(wanted_params):]:
        if extra.default is inspect.Parameter.empty and extra.kind not in (inspect.Parameter.VAR_POSITIONAL,
                                                                           inspect.Parameter.VAR_KEYWORD):
            problems.append(f"{method_name}: extra parameter {extra.name} has no default")
    return problems


def conformance_problems(cls: type, protocol: type) -> list[str]:
    problems = []
    for name in protocol_methods(protocol):
        method = getattr(cls, name, None)
        if not callable(method):
            problems.append(f"no method {name}")
            continue
        problems += signature_problems(name, inspect.signature(getattr(protocol, name)), inspect.signature(method))
    attributes = assigned_attributes(cls)
    problems += [f"no attribute {name}" for name in typing.get_type_hints(protocol, localns={"SimState": object})
                 if name not in attributes]
    return problems


def test_the_protocols_declare_what_the_round_loop_calls():
    # A rename or a dropped method in a Protocol changes these lists (and fails the checks below).
    assert protocol_methods(Runtime) == ["fit_stream", "fit_many", "evaluate_many", "describe_devices", "close"]
    assert protocol_methods(Clients) == ["start", "reports", "train", "evaluate", "describe_devices"]
    assert protocol_methods(EvaluatesNewClients) == ["evaluate_new"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_runtime_satisfies_the_runtime_protocol(backend):
    cls = RUNTIME_CLASSES[backend]
    assert conformance_problems(cls, Runtime) == []
    assert cls.name == backend  # the name the config and build.RUNTIMES use


def test_local_clients_satisfy_clients_and_evaluate_new_clients():
    assert conformance_problems(LocalClients, Clients) == []
    assert conformance_problems(LocalClients, EvaluatesNewClients) == []


def test_flower_clients_satisfy_clients_but_not_evaluate_new_clients():
    pytest.importorskip("flwr")
    from pfedkit.flower.server import FlowerClients

    assert conformance_problems(FlowerClients, Clients) == []
    # Simulation refuses new_clients with it (isinstance against EvaluatesNewClients).
    assert conformance_problems(FlowerClients, EvaluatesNewClients) == ["no method evaluate_new"]


def test_the_checker_catches_a_missing_parameter_a_renamed_method_and_a_missing_attribute():
    class DropsAParameter(SequentialRuntime):
        def evaluate_many(self):  # items dropped
            return {}

    class RenamesAParameter(SequentialRuntime):
        def fit_many(self, requests):
            return {}

    class NeedsAnExtraArgument(SequentialRuntime):
        def close(self, force):
            pass

    class Renamed:
        def fit_stream(self, jobs): ...
        def fit_many(self, jobs): ...
        def evaluate_many(self, items): ...
        def describe_devices(self): ...
        def shutdown(self): ...

    class DeviceAsAnAttribute:  # the summary's device must be asked for, not probed for
        device = None

        def fit_stream(self, jobs): ...
        def fit_many(self, jobs): ...
        def evaluate_many(self, items): ...
        def close(self): ...

    assert conformance_problems(DropsAParameter, Runtime) == [
        "evaluate_many: parameter 1 should be items (positional or keyword), found nothing"]
    assert conformance_problems(RenamesAParameter, Runtime) == [
        "fit_many: parameter 1 should be jobs (positional or keyword), found requests (positional or keyword)"]
    assert conformance_problems(NeedsAnExtraArgument, Runtime) == ["close: extra parameter force has no default"]
    assert conformance_problems(Renamed, Runtime) == ["no method close"]
    assert conformance_problems(DeviceAsAnAttribute, Runtime) == ["no method describe_devices"]

    class Named(Protocol):  # a protocol declaring an attribute
        name: str

    assert conformance_problems(SequentialRuntime, Named) == []  # a class attribute
    assert conformance_problems(Renamed, Named) == ["no attribute name"]


def test_backend_table_config_and_command_line_name_the_same_backends():
    assert tuple(build.RUNTIMES) == BACKENDS
    assert typing.get_args(Config.model_fields["backend"].annotation) == BACKENDS
    from pfedkit.cli import build_parser

    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    assert tuple(next(a for a in bench._actions if a.dest == "backend").choices) == BACKENDS
    with pytest.raises(ImportError, match="'tpu'"):
        build.check_backends({**build.RUNTIMES, "tpu": build.sequential_runtime}, BACKENDS)
    with pytest.raises(ImportError, match="differ"):  # same names, another order
        build.check_backends(dict(reversed(build.RUNTIMES.items())), BACKENDS)


def test_unknown_backend_error_is_one_line_naming_the_allowed_ones():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["backend=gpu"])
    assert str(err.value) == "backend: Input should be 'sequential', 'processes', 'vectorized' or 'ray' (got 'gpu')"
    unchecked = load_config(None, ["device=cpu"]).model_copy(update={"backend": "gpu"})  # past the config's check
    with pytest.raises(ConfigError, match=r"^backend: 'gpu' is not available; allowed: sequential, processes, "
                                          r"vectorized, ray$"):
        build.make_runtime(unchecked, lambda: None, None, threads=1)


RUNTIME_HOMES = {"sequential": "pfedkit.build", "processes": "pfedkit.build",  # where each factory finds its class
                 "vectorized": "pfedkit.engine.runtimes.vectorized", "ray": "pfedkit.engine.runtimes.ray"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_backend_builds_its_runtime_with_the_thread_count_it_is_given(backend, monkeypatch):
    """`make_runtime` passes the count the run decided (`build.run_threads`), not the config's."""
    received = []

    class Recorder:
        def __init__(self, *args, threads, **kwargs):
            received.append(threads)

    monkeypatch.setattr(f"{RUNTIME_HOMES[backend]}.{RUNTIME_CLASSES[backend].__name__}", Recorder)
    config = load_config(None, [f"backend={backend}", "device=cpu", "threads=3"])
    build.make_runtime(config, lambda: None, None, threads=5)
    assert received == [5]


@pytest.mark.parametrize("backend", ["sequential", "vectorized"])
def test_the_table_builds_the_configured_runtime(backend, small_config):
    from pfedkit.data.datasets import load_dataset
    from pfedkit.data.federated import build_federated
    from pfedkit.federation import split_plan

    config = load_config({**small_config, "backend": backend, "device": "cpu"})
    data = build_federated(split_plan(config), load_dataset(config.dataset, config.data_dir), False)
    _, archs = build.build_algorithm(config, data.input_shape, data.num_classes, data.train_counts())
    runtime = build.make_runtime(config, archs, data, threads=2)
    try:
        assert type(runtime) is RUNTIME_CLASSES[backend] and isinstance(runtime, Runtime)
        assert runtime.threads == 2 and runtime.describe_devices().startswith("cpu (")
    finally:
        runtime.close()
