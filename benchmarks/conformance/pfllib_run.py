"""Running a PFLlib checkout on an exported pfedkit partition, from a scratch folder.

Nothing is written into the checkout. The scratch folder holds:
    stubs/               packages PFLlib imports at module level but never calls for these methods
    seeded_main.py       the launcher: seeds, then runs the checkout's system/main.py as __main__
    run/system/          PFLlib's working directory (it reads ../dataset, writes ../results, models/)
    run/dataset/<NAME>/  the exported clients (pfllib_data.py)
    logs/                one log per method and seed: the curves are read from it

Stubs, written only for packages this Python cannot import (each raises, naming itself, if a
method does use it, except calmsize's `size`, which MemReporter's closing report calls: it
returns the byte count unformatted):
    torchvision  main.py imports it for the ResNet/GoogleNet models only
    calmsize     utils/mem_utils.py (MemReporter, printed at the end of main.py)
    cvxpy        serverpac.py (FedPAC's head weights): FedPAC needs the real package
h5py is not stubbed: the server saves its curve with it and main.py reads it back at the end
(`pip install h5py`). matplotlib (utils/dlg.py) is a pfedkit dependency already.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

from scratch import place_stub, saved_initial_weights, stubbed_environment, write_raising_stubs, write_text

STUBBED = {
    "torchvision": "main.py imports it for torchvision's ResNet and GoogleNet models only",
    "cvxpy": "serverpac.py imports it for FedPAC's head weights",
}
CALMSIZE_STUB = '''"""Stub of calmsize for PFLlib's MemReporter (pfedkit conformance): sizes stay byte counts."""


def size(num_bytes):
    return float(num_bytes)
'''
LAUNCHER = '''"""pfedkit conformance: run PFLlib's system/main.py with seed SEED added to every torch seed it sets
(main.py seeds torch with 0 at import, each client again with 0) and numpy and random seeded with SEED.
Usage: python seeded_main.py PFLLIB_SYSTEM SEED MAIN_ARGUMENTS..."""
import os
import random
import runpy
import sys

import numpy
import torch

system, seed = sys.argv[1], int(sys.argv[2])
del sys.argv[1:3]
manual_seed = torch.manual_seed
torch.manual_seed = lambda value: manual_seed(value + seed)
numpy.random.seed(seed)
random.seed(seed)
sys.path.insert(0, system)
sys.argv[0] = os.path.join(system, "main.py")
runpy.run_path(sys.argv[0], run_name="__main__")
'''
INITIAL_WEIGHTS = '''"""pfedkit conformance: save the FedAvgCNN PFLlib's main.py starts from under seed SEED.
main.py seeds torch with 0 at import (seeded_main.py adds SEED) and draws nothing before building the
model. Usage: python initial_weights.py PFLLIB_SYSTEM SEED IN_FEATURES NUM_CLASSES DIM OUT"""
import sys

import torch

system, seed, in_features, num_classes, dim, out = sys.argv[1], *map(int, sys.argv[2:6]), sys.argv[6]
sys.path.insert(0, system)
from flcore.trainmodel.models import FedAvgCNN  # noqa: E402

torch.manual_seed(0 + seed)
model = FedAvgCNN(in_features=in_features, num_classes=num_classes, dim=dim)
torch.save(dict(model.state_dict()), out)
'''
ROUND = re.compile(r"Round number: (\d+)")
ACCURACY = re.compile(r"Averaged Test Accuracy: ([0-9.]+)")
TIME_COST = re.compile(r"^-+ time cost -+ ([0-9.eE+-]+)\s*$")
DEVICE = re.compile(r"^device = (\S+)\s*$")


def prepare_scratch(scratch: Path) -> Path:
    """Write the stubs and the launcher into `scratch`; returns the launcher's path."""
    stubs = scratch / "stubs"
    write_raising_stubs(stubs, STUBBED, "PFLlib")
    place_stub(stubs, "calmsize", {"__init__.py": CALMSIZE_STUB}, needed=importlib.util.find_spec("calmsize") is None)
    (scratch / "run" / "system").mkdir(parents=True, exist_ok=True)
    launcher = scratch / "seeded_main.py"
    write_text(launcher, LAUNCHER)
    return launcher


def pfllib_system(checkout: Path) -> Path:
    """The checkout's system/ folder; SystemExit when `checkout` is not a PFLlib tree."""
    system = Path(checkout).resolve() / "system"
    if not (system / "main.py").is_file():
        raise SystemExit(f"{checkout}: not a PFLlib checkout (no system/main.py)")
    return system


def run_pfllib(checkout: Path, scratch: Path, seed: int, arguments: list[str], log: Path) -> int:
    """Run main.py of `checkout` with `arguments` (mapping.pfllib_arguments) and the seed; its output
    goes to `log`. Returns the exit code."""
    launcher = prepare_scratch(scratch)
    system = pfllib_system(checkout)
    env = stubbed_environment(scratch / "stubs", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    log.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-u", str(launcher.resolve()), str(system), str(seed), *arguments]
    with open(log, "w") as out:
        out.write("# " + " ".join(command[3:]) + "\n")
        out.flush()
        return subprocess.call(command, cwd=scratch / "run" / "system", env=env, stdout=out, stderr=subprocess.STDOUT)


def pfllib_initial_weights(checkout: Path, scratch: Path, seed: int, model: tuple[int, int, int], out: Path) -> Path:
    """`out`: the weights PFLlib's run of `seed` starts from, built by the checkout's own FedAvgCNN
    (`model`: in_features, num_classes, dim), under pfedkit's names (`conv1.0.weight` ->
    `conv1.weight`, which config `init_weights` reads). Kept if present."""
    if out.is_file():
        return out
    system = pfllib_system(checkout)
    prepare_scratch(scratch)
    return saved_initial_weights(scratch / "initial_weights.py", INITIAL_WEIGHTS,
                                 [str(system), str(seed), *map(str, model)], stubbed_environment(scratch / "stubs"),
                                 out, pfedkit_layer_name)


def pfedkit_layer_name(pfllib_name: str) -> str:
    """PFLlib's FedAvgCNN keeps each layer in an nn.Sequential (`conv1.0.weight`); pfedkit names the
    layer itself (`conv1.weight`): the numeric parts go."""
    return ".".join(part for part in pfllib_name.split(".") if not part.isdigit())


def curve_from_log(text: str, which: str = "last") -> dict[int, float]:
    """{round: accuracy (fraction)} from a PFLlib log: per 'Round number: r' block, the first or the
    last 'Averaged Test Accuracy' (`which`) printed before the next block or 'Best accuracy.'."""
    blocks: dict[int, list[float]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("Best accuracy."):
            current = None
        elif match := ROUND.search(line):
            current = int(match.group(1))
            blocks[current] = []
        elif current is not None and (match := ACCURACY.search(line)):
            blocks[current].append(float(match.group(1)))
    pick = 0 if which == "first" else -1
    return {rnd: values[pick] for rnd, values in blocks.items() if values}


def time_costs_from_log(text: str) -> list[float]:
    """PFLlib's own seconds per round from a log, in order: the '--- time cost --- s' line its servers
    print after each round (round 0 first; the evaluation of the round is inside the time)."""
    return [float(match.group(1)) for line in text.splitlines() if (match := TIME_COST.match(line))]


def device_from_log(text: str) -> str | None:
    """The device PFLlib ran on, from the arguments main.py prints (after it falls back from cuda to
    cpu when CUDA is unavailable); None when the log has no such line."""
    return next((match.group(1) for line in text.splitlines() if (match := DEVICE.match(line))), None)
