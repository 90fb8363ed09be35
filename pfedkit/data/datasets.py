"""The datasets pfedkit knows (`DATASETS`) and `load_dataset`, which picks the loader.

Adding a dataset is one `DatasetInfo` row in `DATASETS` (classes, input shape, size, its default
model, its file format `kind`), plus, if `pfedkit data fetch` should download it, its entry in
data/sources.py. Everything else reads the table: config validation, `model: auto`, `pfedkit
list`, `reproduce`'s data checks, `data fetch`.

Every loader returns a `Dataset` (data/store.py): the images as stored (uint8), which its `rows`
turns into float32 normalised as the papers do (PFLlib: ToTensor then Normalize(0.5, 0.5) ->
values in [-1, 1]), integer labels, and a boolean mask of the official test split. The loaders:
the embedded `digits` (here), the image sets' `<name>/<name>.npz.xz` (data/images.py), token ids
(data/text.py) and `hf:` datasets (data/hf.py). Files are checked against `SHA256SUMS` when the
data directory has one and decoded once into a local cache (data/store.py).
"""
from __future__ import annotations

import numpy as np

from pfedkit.data.hf import is_hf, load_hf_dataset
from pfedkit.data.images import load_images
from pfedkit.data.store import DataError, Dataset, DatasetInfo, cache_root, dataset_path, resolve_data_dir, resolved
from pfedkit.data.text import load_text_dataset

# Re-exported: callers import the loader's argument and error types from here with it.
__all__ = ["DATASETS", "DataError", "Dataset", "DatasetInfo", "data_present", "dataset_info", "default_model",
           "load_dataset", "resolve_data_dir"]

DATASETS: dict[str, DatasetInfo] = {
    "digits": DatasetInfo("digits", 10, (64,), 1797, True,
                          "scikit-learn's bundled 8x8 handwritten digits (embedded default)", model="mlp",
                          kind="features"),
    "mnist": DatasetInfo("mnist", 10, (1, 28, 28), 70000, False, "MNIST 28x28 grayscale digits", model="cnn"),
    "fashion_mnist": DatasetInfo("fashion_mnist", 10, (1, 28, 28), 70000, False,
                                 "Fashion-MNIST 28x28 grayscale clothing", model="cnn"),
    "cifar10": DatasetInfo("cifar10", 10, (3, 32, 32), 59897, False,
                           "CIFAR-10 32x32 colour (shared copy: 59,897 of 60,000 images; fetched: all)", model="cnn"),
    "cifar100": DatasetInfo("cifar100", 100, (3, 32, 32), 60000, False,
                            "CIFAR-100 32x32 colour, 100 fine classes (pfedkit data fetch cifar100)", model="cnn"),
    # DA-PFL's CIFAR-100: "the first 20 classes" (fine labels 0-19, 500 train + 100 test images each);
    # its model: DA-PFL's (FedRep's CNNCifar100)
    "cifar100_first20": DatasetInfo("cifar100_first20", 20, (3, 32, 32), 12000, False,
                                    "CIFAR-100 fine classes 0-19 only, relabelled 0-19 (DA-PFL; file: cifar100)",
                                    model="cnn_cifar100", source="cifar100", classes=tuple(range(20))),
    # No official test split: every row is training data; split per client (test_split per_client).
    "femnist": DatasetInfo("femnist", 62, (1, 28, 28), 814277, False,
                           "FEMNIST 28x28 grayscale, 62 classes (0-9, A-Z, a-z), writer ids kept, no official "
                           "test split (pfedkit data fetch femnist)", model="cnn", writers=True),
    # DA-PFL's FEMNIST: "10 lowercase letters"; which ten is not stated: a-j (labels 36-45) [ours];
    # its model: DA-PFL's MLP with two hidden layers
    "femnist_lower10": DatasetInfo("femnist_lower10", 10, (1, 28, 28), 814277, False,
                                   "FEMNIST lowercase letters a-j only, relabelled 0-9 (DA-PFL; file: femnist; "
                                   "sample count: the full set's, an upper bound)", model="mlp",
                                   writers=True, source="femnist", classes=tuple(range(36, 46))),
    # cwFedAvg's Tiny ImageNet* and PFedCS use ResNet-18
    "tiny_imagenet": DatasetInfo("tiny_imagenet", 200, (3, 64, 64), 110000, False,
                                 "Tiny-ImageNet 64x64 colour, 200 classes; the official val split is the test "
                                 "split (pfedkit data fetch tiny_imagenet)", model="resnet18"),
    # Text: token ids (N, 200), tokenised once by `pfedkit data fetch ag_news` (pfedkit/data/text.py);
    # the model of cwFedAvg's Table 6
    "ag_news": DatasetInfo("ag_news", 4, (200,), 127600, False,
                           "AG News text, 4 classes, 200 token ids per row (cwFedAvg; pfedkit data fetch ag_news)",
                           model="fasttext", kind="text"),
}

# The loader of each file format (`DatasetInfo.kind`); `features` is the embedded digits only.
LOADERS = {"image": load_images, "text": load_text_dataset}


def dataset_info(name: str) -> DatasetInfo:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; allowed: {', '.join(DATASETS)}")
    return DATASETS[name]


def default_model(dataset: str) -> str:
    """The model a dataset uses unless the config names one."""
    if is_hf(dataset):  # images of any size: the CNN (tiny images need model=mlp)
        return "cnn"
    if dataset not in DATASETS:
        from pfedkit.models import model_names

        raise ValueError(f"no default model for dataset {dataset!r}; known datasets: {', '.join(DATASETS)} "
                         f"(or name a model explicitly: {', '.join(model_names())})")
    return DATASETS[dataset].model


def load_dataset(name: str, data_dir: str | None = None, cache_dir: str | None = None,
                 options=None) -> Dataset:
    """`options`: the columns and revision of `hf:` datasets (data/hf.py's HFOptions, or the
    config's `data` section, which has the same attributes)."""
    if is_hf(name):  # a Hugging Face dataset, converted once (pfedkit/data/hf.py)
        return load_hf_dataset(name, options, cache_dir)
    info = dataset_info(name)
    if info.embedded:
        return _load_digits()
    root = resolve_data_dir(data_dir)
    if root is None:
        file = info.file_name
        raise DataError(f"dataset {name!r} needs a data directory: set data_dir=PATH or the "
                        f"PFEDKIT_DATA environment variable to a folder holding {file}/{file}.npz.xz "
                        f"(get it with `pfedkit data fetch {file} --data-dir DIR`)")
    path = resolved(dataset_path(root, info.file_name))
    stat = path.stat() if path.is_file() else None
    # the file's size and mtime in the key: a file fetched again is read again
    key = (name, str(path), stat and (stat.st_size, stat.st_mtime_ns),
           str(cache_root(cache_dir)))
    if key not in _LOADED:  # runs of a comparison in one process decode and normalise once
        file_info = DATASETS[info.file_name]
        full = LOADERS[file_info.kind](file_info, root, cache_dir)
        _LOADED.clear()  # one dataset held at a time
        _LOADED[key] = _class_subset(full, info)
    return _LOADED[key]


_LOADED: dict[tuple, Dataset] = {}  # callers must not modify a Dataset's arrays


def data_present(name: str, data_dir: str | None = None) -> bool:
    """Whether `name`'s file is in the data directory (embedded sets always are); nothing is read."""
    info = dataset_info(name)
    if info.embedded:
        return True
    root = resolve_data_dir(data_dir)
    return root is not None and dataset_path(root, info.file_name).is_file()


def _class_subset(full: Dataset, info: DatasetInfo) -> Dataset:
    """`full` itself, or (info.classes) its rows of those classes, relabelled 0..k-1 in that order;
    writer ids keep pointing into the full set's writer_names."""
    if info.classes is None:
        return full
    relabel = np.full(full.num_classes, -1, dtype=np.int64)
    relabel[list(info.classes)] = np.arange(len(info.classes))
    keep = np.flatnonzero(relabel[full.y] >= 0)
    return Dataset(info.name, full.stored[keep], relabel[full.y[keep]], full.official_test[keep],
                   info.num_classes, None if full.writer is None else full.writer[keep], full.writer_names)


def _load_digits() -> Dataset:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    # 16 grey levels -> [-1, 1], the same convention as the image sets.
    x = (bunch.data.astype(np.float32) / 16.0 - 0.5) / 0.5
    y = bunch.target.astype(np.int64)
    # No official split exists: hold out a fixed, label-stratified quarter (every 4th sample of
    # each class) so that "official test" partitions work on digits too.
    test = np.zeros(len(y), dtype=bool)
    for c in np.unique(y):
        test[np.flatnonzero(y == c)[3::4]] = True
    return Dataset("digits", x, y, test, 10)
