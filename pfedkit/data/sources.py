"""Where `pfedkit data fetch` gets each dataset: `SOURCES`, one entry per downloadable dataset
file (its published files with their mirrors and MD5s, or its Hugging Face Hub repository; the
function converting them into pfedkit's arrays; the citation written to SOURCE.txt).

A new downloadable dataset is one entry here (plus its row in data/datasets.py's DATASETS, whose
`kind` says how the converted file is checked and written). Conversions: data/converters.py
(image formats), data/text.py (CSV text).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from pfedkit.data.converters import (convert_cifar10, convert_cifar100, convert_femnist, convert_idx,
                                     convert_tiny_imagenet)
from pfedkit.data.store import NamedArrays
from pfedkit.data.text import convert_csv_pair


@dataclass(frozen=True)
class SourceFile:
    """One published file: where it lives (mirrors tried in order) and its published MD5."""
    filename: str
    urls: tuple[str, ...]
    md5: str


@dataclass(frozen=True)
class Source:
    """Published files downloaded by URL (resumable, MD5-checked: data/download.py)."""
    files: tuple[SourceFile, ...]
    # ({filename: downloaded path} in the order of `files`, progress) -> arrays (x, y, test tuple or by name)
    convert: Callable[..., tuple[np.ndarray, np.ndarray, np.ndarray] | NamedArrays]
    citation: str


@dataclass(frozen=True)
class HubSource:
    """A dataset published on the Hugging Face Hub as parquet shards, read with `datasets`."""
    repo_id: str
    convert: Callable[[list[Path], bool], NamedArrays]  # (parquet files, progress) -> arrays
    citation: str
    revision: str | None = None  # None: the Hub's default branch


def _idx_files(mirrors: tuple[str, ...], md5s: dict[str, str]) -> tuple[SourceFile, ...]:
    return tuple(SourceFile(name, tuple(base + name for base in mirrors), md5) for name, md5 in md5s.items())


AG_NEWS_CSV = "https://raw.githubusercontent.com/mhjabreel/CharCnn_Keras/master/data/ag_news_csv/"

# Canonical sources (torchvision's mirrors first where the original host refuses scripts) and the
# MD5 checksums published with them.
SOURCES: dict[str, Source | HubSource] = {
    "mnist": Source(_idx_files(
        ("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/"),
        {"train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
         "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
         "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
         "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c"}), convert_idx,
        "Y. LeCun, C. Cortes, C. J. C. Burges, the MNIST database"),
    "fashion_mnist": Source(_idx_files(
        ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
         "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/"),
        {"train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
         "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
         "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
         "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310"}), convert_idx,
        "H. Xiao, K. Rasul, R. Vollgraf, Fashion-MNIST, arXiv:1708.07747"),
    "cifar10": Source((SourceFile("cifar-10-python.tar.gz",
                                  ("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
                                   "https://cave.cs.toronto.edu/kriz/cifar-10-python.tar.gz"),
                                  "c58f30108f718f92721af3b95e74349a"),), convert_cifar10,
                      "A. Krizhevsky, Learning Multiple Layers of Features from Tiny Images, 2009"),
    "cifar100": Source((SourceFile("cifar-100-python.tar.gz",
                                   ("https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
                                    "https://cave.cs.toronto.edu/kriz/cifar-100-python.tar.gz"),
                                   "eb9058c3a382ffc7106e4002c42a8d85"),), convert_cifar100,
                       "A. Krizhevsky, Learning Multiple Layers of Features from Tiny Images, 2009"),
    "tiny_imagenet": Source((SourceFile("tiny-imagenet-200.zip", ("http://cs231n.stanford.edu/tiny-imagenet-200.zip",),
                                        "90528d7ca1a48142e341f4ef8d21d0de"),), convert_tiny_imagenet,
                            "Stanford CS231n Tiny ImageNet (200 ImageNet classes at 64x64; Le and Yang, 2015)"),
    "femnist": HubSource("flwrlabs/femnist", convert_femnist,
                         "LEAF FEMNIST (S. Caldas et al., arXiv:1812.01097) from NIST SD19, as published by "
                         "Flower Labs on the Hugging Face Hub (flwrlabs/femnist)"),
    "ag_news": Source((SourceFile("train.csv", (AG_NEWS_CSV + "train.csv",), "b1a00f826fdfbd249f79597b59e1dc12"),
                       SourceFile("test.csv", (AG_NEWS_CSV + "test.csv",), "d52ea96a97a2d943681189a97654912d")),
                      partial(convert_csv_pair, class_names=("World", "Sports", "Business", "Sci/Tech")),
                      "X. Zhang, J. Zhao, Y. LeCun, Character-level Convolutional Networks for Text Classification, "
                      "NeurIPS 2015 (AG's news corpus; the CSVs torchtext used)"),
}


def fetchable() -> list[str]:
    return list(SOURCES)
