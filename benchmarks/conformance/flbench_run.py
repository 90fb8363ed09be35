"""Running an FL-bench checkout on an exported pfedkit partition, from a scratch folder.

Nothing is written into the checkout. FL-bench reads its data from `data/<name>/` beside its
`main.py` and writes its outputs under the working folder (`out/<method>/<dataset>/<time>/`), so
each split, seed and method gets a copy of the checkout's code (main.py, config/, src/, data/utils/:
about 1 MB) in a folder of its own, with the split's export of the seed linked as its `data/<name>/`
(one folder per method label: FedAdam, FedYogi and FedAdagrad are all FL-bench's `fedopt`):

    flbench/stubs/                          packages FL-bench imports but these runs never call
    flbench/data/<split>-s<seed>/<name>/    the export (flbench_data.py), written once per split and seed
    flbench/run/<split>-s<seed>/<method>/   main.py, config/, src/, data/utils/ (copies), data/<name> (a link
                                            to the export), out/ (FL-bench's output: metrics.csv)
    logs/<split>/FL-bench-<method>-s<seed>.log

Stubs, written only where this Python cannot import the real package:
    torchvision  PyPI's torchvision does not load beside the local CPU build of torch: the stub's
                 transforms.Compose and transforms.Normalize compute what torchvision's do on a tensor;
                 its datasets.MNIST / FashionMNIST / CIFAR10 serve the export's samples (flbench_data.py);
                 everything else (models, io, other transforms) raises, naming itself, when used
    pynvml       src/utils/functional.py imports it for choosing a CUDA device only
    faiss        src/client/knnper.py (kNN-Per's memory): kNN-Per needs the real faiss-cpu
FL-bench's own dependencies that these runs do use are not stubbed: hydra-core and omegaconf
(`pip install hydra-core`), ray, rich, pandas, scikit-learn, Pillow.
"""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd

from scratch import place_stub, saved_initial_weights, stubbed_environment, write_raising_stubs

CODE = ("main.py", "config", "src", Path("data") / "utils")
STUBBED = {
    "pynvml": "src/utils/functional.py imports it to choose a CUDA device",
    "faiss": "src/client/knnper.py imports it for kNN-Per's memory",
}
TORCHVISION = {
    "__init__.py": '''"""Stub of torchvision for running FL-bench beside pfedkit (benchmarks/conformance/flbench_run.py)."""
from . import datasets, io, models, transforms  # noqa: F401
''',
    "transforms.py": '''"""torchvision.transforms as FL-bench uses it on tensors: Compose and Normalize; the rest raises."""
import torch


class Compose:
    def __init__(self, transforms):
        self.transforms = list(transforms)

    def __call__(self, x):
        for transform in self.transforms:
            x = transform(x)
        return x


class Normalize:
    """(x - mean) / std per channel of a (..., C, H, W) tensor, as torchvision's functional.normalize."""

    def __init__(self, mean, std, inplace=False):
        self.mean, self.std = mean, std

    def __call__(self, x):
        mean = torch.as_tensor(self.mean, dtype=x.dtype, device=x.device).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=x.dtype, device=x.device).view(-1, 1, 1)
        return (x - mean) / std


def __getattr__(attribute):
    raise ImportError(f"torchvision.transforms.{attribute} is not in the conformance stub")
''',
    "datasets.py": '''"""torchvision.datasets as FL-bench's MNIST / FashionMNIST / CIFAR10 classes read them: the train part is
the pfedkit export's samples and targets (flbench_data.py), the test part is empty."""
from pathlib import Path

import numpy as np


class _Exported:
    def __init__(self, root, train=True, download=False, **unused):
        samples = np.load(Path(root) / "pfedkit_samples.npy")
        targets = np.load(Path(root) / "pfedkit_targets.npy")
        self.data = samples if train else samples[:0]
        self.targets = targets if train else targets[:0]


MNIST = FashionMNIST = CIFAR10 = _Exported


def __getattr__(attribute):
    raise ImportError(f"torchvision.datasets.{attribute} is not in the conformance stub")
''',
    "models.py": '''"""torchvision.models: FL-bench's model table names them in class bodies (models.ResNet18_Weights.DEFAULT);
these runs use avgcnn. A name resolves to a placeholder that raises when a model is built from it."""


class _Missing:
    def __init__(self, name):
        self.name = name

    def __getattr__(self, attribute):
        return _Missing(f"{self.name}.{attribute}")

    def __call__(self, *args, **kwargs):
        raise ImportError(f"torchvision.models.{self.name} is not in the conformance stub (these runs use avgcnn)")


def __getattr__(attribute):
    return _Missing(attribute)
''',
    "io/__init__.py": "from . import image  # noqa: F401\n",
    "io/image.py": '''"""torchvision.io.image: FL-bench imports these names for image-folder datasets only."""


class ImageReadMode:
    RGB = "RGB"


def read_image(*args, **kwargs):
    raise ImportError("torchvision.io.read_image is not in the conformance stub")
''',
}
INITIAL_WEIGHTS = '''"""pfedkit conformance: save the FedAvgCNN FL-bench's server starts from under seed SEED: fix_random_seed
seeds torch with SEED and nothing draws from torch before init_model builds the model (src/server/fedavg.py).
Usage: python initial_weights.py FLBENCH_ROOT SEED DATASET OUT"""
import sys

sys.dont_write_bytecode = True  # nothing is written into the checkout
import torch  # noqa: E402

root, seed, dataset, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
sys.path.insert(0, root)
from src.utils.models import FedAvgCNN  # noqa: E402

torch.manual_seed(seed)
torch.save(dict(FedAvgCNN(dataset, False).state_dict()), out)
'''
CONSTANTS = '''import json, sys
sys.path.insert(0, sys.argv[1])
from src.utils.constants import DATA_MEAN, DATA_STD
print(json.dumps({"mean": DATA_MEAN[sys.argv[2]], "std": DATA_STD[sys.argv[2]]}))
'''


def flbench_root(checkout: Path) -> Path:
    """The checkout's root; SystemExit when `checkout` is not an FL-bench tree."""
    root = Path(checkout).resolve()
    if not ((root / "main.py").is_file() and (root / "src" / "server" / "fedavg.py").is_file()):
        raise SystemExit(f"{checkout}: not an FL-bench checkout (no main.py and src/server/fedavg.py)")
    return root


def prepare_stubs(scratch: Path) -> Path:
    stubs = scratch / "flbench" / "stubs"
    write_raising_stubs(stubs, STUBBED, "FL-bench")
    place_stub(stubs, "torchvision", TORCHVISION,
               needed=importlib.util.find_spec("torchvision") is None or not torchvision_loads())
    return stubs


def torchvision_loads() -> bool:
    """Whether this Python's torchvision imports (PyPI's fails beside a local torch build)."""
    return subprocess.call([sys.executable, "-c", "import torchvision.transforms"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL) == 0


def environment(scratch: Path) -> dict[str, str]:
    """This process's environment, the stubs first on PYTHONPATH, one torch thread."""
    return stubbed_environment(scratch / "flbench" / "stubs", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                               HYDRA_FULL_ERROR="1")


def run_folder(checkout: Path, folder: Path) -> Path:
    """`folder` with copies of the checkout's code (refreshed each call)."""
    root = flbench_root(checkout)
    for part in CODE:
        source, target = root / part, folder / part
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return folder


def normalisation(checkout: Path, scratch: Path, dataset: str) -> tuple[list[float], list[float]]:
    """FL-bench's DATA_MEAN and DATA_STD of `dataset`, read from the checkout's src/utils/constants.py."""
    prepare_stubs(scratch)
    out = subprocess.run([sys.executable, "-c", CONSTANTS, str(flbench_root(checkout)), dataset],
                         env=environment(scratch), capture_output=True, text=True, check=True).stdout
    values = json.loads(out.strip().splitlines()[-1])
    return list(values["mean"]), list(values["std"])


def flbench_initial_weights(checkout: Path, scratch: Path, seed: int, dataset: str, out: Path) -> Path:
    """`out`: the weights FL-bench's run of `seed` starts from, built by the checkout's own FedAvgCNN, under
    pfedkit's names (`base.conv1.weight` -> `conv1.weight`, `classifier.weight` -> `fc.weight`), which config
    `init_weights` reads. Kept if present. (Under seed s they are also PFLlib's: both seed torch with s and
    build the same layers in the same order before drawing anything else.)"""
    if out.is_file():
        return out
    prepare_stubs(scratch)
    return saved_initial_weights(scratch / "flbench" / "initial_weights.py", INITIAL_WEIGHTS,
                                 [str(flbench_root(checkout)), str(seed), dataset], environment(scratch), out,
                                 pfedkit_layer_name)


def pfedkit_layer_name(flbench_name: str) -> str:
    """FL-bench's FedAvgCNN keeps the body in `base` and the last layer as `classifier`; pfedkit names the
    layers themselves and the last one `fc`."""
    name = flbench_name.removeprefix("base.")
    return "fc" + name[len("classifier"):] if name.startswith("classifier.") else name


def run_flbench(folder: Path, scratch: Path, arguments: list[str], log: Path) -> int:
    """`python main.py ARGUMENTS` in `folder` (hydra overrides: mapping.flbench_arguments); output to `log`."""
    prepare_stubs(scratch)
    log.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-u", "main.py", *arguments]
    with open(log, "w") as out:
        out.write("# " + " ".join(command[2:]) + "\n")
        out.flush()
        return subprocess.call(command, cwd=folder, env=environment(scratch), stdout=out, stderr=subprocess.STDOUT)


def metrics_file(folder: Path, method: str, dataset: str) -> Path | None:
    """The newest finished run's metrics.csv of `method` in a run folder (None when none finished)."""
    found = sorted((folder / "out" / method / dataset).glob("*/metrics.csv"))
    return found[-1] if found else None


CLIENT_LINE = re.compile(r"client \[(\d+)\]\s+\(testset\)\s+loss: \S+ -> \S+\s+accuracy: ([0-9.]+)% ->")
EPOCH_LINE = re.compile(r"TRAINING EPOCH: (\d+)")
TEST_ACCURACY = {"before": re.compile(r"([0-9.]+)% ->"), "after": re.compile(r"-> ([0-9.]+)%")}


def curve_from_client_lines(text: str, test_rows: list[int]) -> dict[int, float]:
    """{epoch: accuracy (fraction)} pooled from the per-client lines of a main.log ('client [i] (testset)
    ... accuracy: before% -> after%', printed every epoch with common.verbose_gap=1 under 'TRAINING
    EPOCH: e + 1'): each client's 'before' accuracy weighted by its test rows. For methods whose
    metrics.csv pools fewer clients than trained (FL-bench's pFedHN keeps only the last one).
    An epoch without a line for every client is left out."""
    epochs: dict[int, dict[int, float]] = {}
    current = None
    for line in text.splitlines():
        if match := EPOCH_LINE.search(line):
            current = int(match.group(1)) - 1
            epochs[current] = {}
        elif current is not None and (match := CLIENT_LINE.search(line)):
            epochs[current][int(match.group(1))] = float(match.group(2))
    total = sum(test_rows)
    return {epoch: sum(accuracy * test_rows[c] for c, accuracy in clients.items()) / (100.0 * total)
            for epoch, clients in epochs.items() if len(clients) == len(test_rows)}


def curve_from_test_results(text: str, side: str = "before") -> dict[int, float]:
    """{key: accuracy (fraction)} of the closing JSON of a main.log (the test_results FL-bench gathers when
    common.test.client.interval > 0: every client, key k after k aggregations): group all_clients, split
    test, 2-decimal percent 'before% -> after%'. `side` "before": the model the test path evaluates (for
    methods whose evaluated model exists only there: CCVR's calibrated head, kNN-Per's interpolation);
    "after": that model fine-tuned for common.test.client.finetune_epoch epochs (FedBABU's evaluation)."""
    start = text.find("Experiment Results:")
    opening = text.find("{", start) if start >= 0 else -1
    if opening < 0:
        return {}
    results, _ = json.JSONDecoder().raw_decode(text[opening:])
    pattern = TEST_ACCURACY[side]
    return {int(key): float(pattern.search(groups["all_clients"]["test"]["accuracy"]).group(1)) / 100.0
            for key, groups in results.items() if "all_clients" in groups}


def curve_from_metrics(path: Path, column: str = "accuracy_test_before") -> dict[int, float]:
    """{epoch: accuracy (fraction)} of FL-bench's metrics.csv. Its 'before' of epoch e is the model a
    client received in epoch e, after e aggregations (epoch 0: the initial model): pfedkit's round e
    with eval_point after_download. Pooled over the round's clients' test rows (sample-weighted)."""
    table = pd.read_csv(path)
    return {int(epoch): float(value) / 100.0 for epoch, value in zip(table["epoch"], table[column])}
