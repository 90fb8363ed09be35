"""What both runners (pfllib_run.py, flbench_run.py) do in a scratch folder: write files, stub the
packages the other library imports but these runs never call, give a process the stubs, and turn the
other library's initial model into a weights file pfedkit's config `init_weights` reads."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

RAISING_STUB = '''"""Stub of {name} for running {library} beside pfedkit (benchmarks/conformance): {why}."""


def __getattr__(attribute):
    raise ImportError("{name} is a stub here ({why}); install the real {name} to run a method that uses it")
'''


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def place_stub(stubs: Path, name: str, files: dict[str, str], needed: bool) -> None:
    """The stub package `name` in `stubs` ({relative path: text}) where `needed`; otherwise any stub an
    earlier run left there is removed: first on the path, it would hide the real package installed since."""
    if needed:
        for relative, text in files.items():
            write_text(stubs / name / relative, text)
    else:
        shutil.rmtree(stubs / name, ignore_errors=True)


def write_raising_stubs(stubs: Path, stubbed: dict[str, str], library: str) -> None:
    """A stub package in `stubs` for each of `stubbed` ({name: why}) that this Python cannot import;
    it imports, and raises naming itself when used (`place_stub`)."""
    for name, why in stubbed.items():
        place_stub(stubs, name, {"__init__.py": RAISING_STUB.format(name=name, why=why, library=library)},
                   needed=importlib.util.find_spec(name) is None)


def stubbed_environment(stubs: Path, **extra: str) -> dict[str, str]:
    """This process's environment, with `extra` and the `stubs` folder first on PYTHONPATH."""
    return dict(os.environ, **extra, PYTHONPATH=os.pathsep.join([str(stubs), os.environ.get("PYTHONPATH", "")]))


def saved_initial_weights(script: Path, text: str, arguments: list[str], env: dict[str, str], out: Path,
                          pfedkit_name: Callable[[str], str]) -> Path:
    """`out`: the state dict that `text` (written to `script`, run with `arguments` and then the raw
    file's path) saves, under pfedkit's layer names (`pfedkit_name`). Kept if present."""
    if out.is_file():
        return out
    import torch

    write_text(script, text)
    raw = out.with_suffix(".raw.pt")
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(script), *arguments, str(raw)], env=env, check=True)
    weights = torch.load(raw, weights_only=True)
    torch.save({pfedkit_name(name): tensor for name, tensor in weights.items()}, out)
    return out
