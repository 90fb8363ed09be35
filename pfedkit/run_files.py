"""The files pfedkit reads back from a run directory, kept as data that cannot run code.

Run directories travel (shared results, `reproduce --reuse`, a colleague's run sent for
`pfedkit report`), and unpickling a file runs whatever the file names. So nothing read back
from a run directory is unpickled:
- `.pt` files (`checkpoints/latest.pt`, `diagnostics.pt`, `client_states/*.pt`) are `torch.save`
  files of *plain* values only: None, bool, int, float, str, tensors, and lists, tuples and dicts
  of them. `torch.load(weights_only=True)` reads them with no allow-list: its loader builds
  tensors and these containers and nothing else, so a planted pickle fails instead of running.
  Other values are written as tagged dicts (`to_plain`): a numpy array as its dtype, shape, memory
  order and raw bytes; a numpy scalar as a 0-d array; an instance of one of the caller's
  `classes` (an explicit allow-list of pfedkit's own types: SimState, DiskStates) as its class
  name and state. `from_plain` rebuilds them and refuses a tag or a class it does not know.
  Tensors are written as torch.save writes them (values, dtype, strides, shared storages), so a
  state read back computes exactly as the one written.
- `.npz` files (`partition.npz`, `clients.npz`) are read with `allow_pickle=False` (numpy's
  default): an array of Python objects is refused.
Every failure to read is one `RunFileError` line naming the file and what to do.
"""
from __future__ import annotations

import dataclasses
import pickle
import re
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from numpy.lib import format as npy_format

from pfedkit.atomic import atomic_torch_save
from pfedkit.core.errors import ConfigError

TAG = "__pfedkit__"  # the key of a tagged dict: what the dict stands for
PRIMITIVES = (type(None), bool, int, float, str)
TENSORS = (torch.Tensor, torch.nn.Parameter)
NO_CLASSES: Mapping[str, type] = {}
RESUME_FIX = "this run cannot be resumed: start a new run (its config.yaml holds its settings)"


class RunFileError(ConfigError):
    """A file of a run directory is missing, damaged, foreign or not data. One line."""


# ---- values <-> plain values -------------------------------------------------------------------

def to_plain(value: Any, classes: Mapping[str, type] = NO_CLASSES, compact: bool = False) -> Any:
    """`value` as plain values (module docstring); raises TypeError for anything else.
    `compact`: a tensor viewing a larger storage as a copy of its own values (`compact_tensor`)."""
    return _Encoder(classes, compact)(value)


def from_plain(plain: Any, classes: Mapping[str, type] = NO_CLASSES) -> Any:
    """The value `to_plain` encoded; ValueError for a tagged dict it does not know."""
    return _Decoder(classes)(plain)


class _Conversion:
    """One walk over a value: primitives (and tensors, unless `converts_tensors`) stay as they
    are; anything else is converted by `_container`, once: an object met twice gives one result,
    so that the file, like a pickle, restores it as one object."""
    converts_tensors = False

    def __init__(self) -> None:
        self.memo: dict[int, tuple[Any, Any]] = {}  # id -> (the object, kept alive so its id stays its own; result)

    def __call__(self, value: Any) -> Any:
        kind = type(value)
        if kind in PRIMITIVES or (kind in TENSORS and not self.converts_tensors):
            return value
        if id(value) not in self.memo:
            self.memo[id(value)] = (value, self._container(value, kind))
        return self.memo[id(value)][1]

    def _container(self, value: Any, kind: type) -> Any:
        raise NotImplementedError


class _Encoder(_Conversion):
    def __init__(self, classes: Mapping[str, type], compact: bool) -> None:
        super().__init__()
        self.names = {cls: name for name, cls in classes.items()}
        self.converts_tensors = compact

    def _container(self, value: Any, kind: type) -> Any:
        if kind in TENSORS:
            return compact_tensor(value)
        if kind is list:
            return [self(item) for item in value]
        if kind is tuple:
            return tuple(self(item) for item in value)
        if kind is dict:
            return self._dict(value)
        if kind is np.ndarray:
            return plain_array(value)
        if isinstance(value, np.generic):
            return {**plain_array(np.asarray(value)), TAG: "numpy_scalar"}
        if kind in self.names:
            return {TAG: "object", "class": self.names[kind], "state": self(_state_of(value))}
        raise TypeError(f"a {kind.__module__}.{kind.__qualname__} cannot be stored as data in a run directory "
                        "(tensors, numbers, strings, None, numpy arrays, and lists, tuples and dicts of them)")

    def _dict(self, value: dict) -> dict:
        if TAG not in value and all(type(key) in PRIMITIVES for key in value):
            return {key: self(item) for key, item in value.items()}
        return {TAG: "dict", "items": [[self(key), self(item)] for key, item in value.items()]}


def _state_of(value: Any) -> Any:
    """What an allow-listed object is stored as: a dataclass's fields, else its `__getstate__`."""
    if dataclasses.is_dataclass(value):
        return {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
    return value.__getstate__()


def compact_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or a copy holding only its own values when it views a larger storage (torch.save
    writes a view's whole storage): a dense one keeps its exact strides, one that skips elements
    becomes contiguous."""
    if tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    values = tensor.detach()
    if _dense(values):
        copy = torch.empty_strided(values.shape, values.stride(), dtype=values.dtype).copy_(values)
    else:
        copy = values.clone(memory_format=torch.contiguous_format)
    return copy.requires_grad_(tensor.requires_grad)


def _dense(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s elements fill its memory span without overlap (empty_strided can remake it)."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()) if size > 0)
    return tensor.numel() > 0 and span == tensor.numel()


def plain_array(array: np.ndarray) -> dict[str, Any]:
    """A numpy array as a tagged dict: its dtype (numpy's .npy description), shape, memory order
    (F for a Fortran-ordered array, as pickle keeps it; C otherwise) and raw bytes."""
    if array.dtype.hasobject:
        raise TypeError("a numpy array of Python objects cannot be stored as data in a run directory")
    order = "F" if array.flags.f_contiguous and not array.flags.c_contiguous else "C"
    raw = bytearray(array.tobytes(order=order))
    data = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return {TAG: "ndarray", "descr": npy_format.dtype_to_descr(array.dtype), "shape": list(array.shape),
            "order": order, "data": data}


class _Decoder(_Conversion):
    def __init__(self, classes: Mapping[str, type]) -> None:
        super().__init__()
        self.classes = classes

    def _container(self, plain: Any, kind: type) -> Any:
        if kind is list:
            return [self(item) for item in plain]
        if kind is tuple:
            return tuple(self(item) for item in plain)
        if kind is not dict:
            raise ValueError(f"it holds a {kind.__name__}, which pfedkit never writes")
        if TAG not in plain:
            return {key: self(item) for key, item in plain.items()}
        tag = plain[TAG]
        if tag == "dict":
            return {self(key): self(item) for key, item in plain["items"]}
        if tag == "ndarray":
            return array_from_plain(plain)
        if tag == "numpy_scalar":
            return array_from_plain(plain)[()]
        if tag == "object":
            return self._object(plain["class"], self(plain["state"]))
        raise ValueError(f"it holds an entry tagged {tag!r}, which pfedkit never writes")

    def _object(self, name: str, state: Any) -> Any:
        """An instance of an allow-listed class: a dataclass through its constructor (which
        checks the field names), another class through `__setstate__`."""
        cls = self.classes.get(name)
        if cls is None:
            raise ValueError(f"it holds an object of class {name!r}, which this file never holds")
        if not isinstance(state, dict) or not all(isinstance(key, str) for key in state):
            raise ValueError(f"the state of its {name} is not a dict of named fields")
        if dataclasses.is_dataclass(cls):
            return cls(**state)
        instance = cls.__new__(cls)
        instance.__setstate__(state)
        return instance


def array_from_plain(plain: Mapping[str, Any]) -> np.ndarray:
    """The numpy array `plain_array` encoded (a writable copy, in its memory order)."""
    dtype = npy_format.descr_to_dtype(plain["descr"])
    shape, order, data = tuple(int(size) for size in plain["shape"]), plain["order"], plain["data"]
    if dtype.hasobject or order not in ("C", "F") or type(data) is not torch.Tensor or data.dtype != torch.uint8:
        raise ValueError("it holds a numpy array that pfedkit did not write")
    if data.numel() != int(np.prod(shape)) * dtype.itemsize:
        raise ValueError(f"a numpy array of shape {shape} holds {data.numel()} bytes")
    flat = np.frombuffer(data.contiguous().numpy(), dtype=dtype)
    return flat.reshape(shape, order=order).copy(order="K")


# ---- files -------------------------------------------------------------------------------------

def write_data(path: str | Path, value: Any, classes: Mapping[str, type] = NO_CLASSES) -> None:
    """`value` as a plain-data `.pt` file, written atomically."""
    atomic_torch_save(path, to_plain(value, classes))


def dump_data(value: Any, handle: BinaryIO) -> None:
    """`value` as a plain-data `.pt` file into an open binary file, every tensor compact (a file
    of its own: no view drags its base's storage in)."""
    torch.save(to_plain(value, compact=True), handle)


def read_data(path: str | Path, what: str, fix: str, classes: Mapping[str, type] = NO_CLASSES) -> Any:
    """The value of a `.pt` file written by `write_data` / `dump_data`. `what` names the file's
    role in the error line ("checkpoint"), `fix` says what to do; RunFileError when the file is
    missing, damaged, or holds anything but plain data (it is never unpickled)."""
    path = Path(path)
    check_data_file(path, what, fix)
    try:
        with warnings.catch_warnings():  # torch warns about what it then refuses: the error says it once
            warnings.simplefilter("ignore")
            plain = torch.load(path, weights_only=True)
    except Exception as err:  # zip, pickle and torch errors alike: the file is not what we write
        raise RunFileError(f"{path}: not a readable {what} ({load_failure(err)}); {fix}") from None
    try:
        return from_plain(plain, classes)
    except (ValueError, TypeError, KeyError, RecursionError) as err:
        raise RunFileError(f"{path}: not a {what} pfedkit wrote ({err}); {fix}") from None


def load_failure(err: Exception) -> str:
    """Why torch's safe loader refused a file, in a few words (its own message is a paragraph)."""
    if isinstance(err, pickle.UnpicklingError):
        named = re.search(r"GLOBAL ([\w.]+)", str(err))
        culprit = f" ({named[1]})" if named else ""
        return (f"it holds Python objects{culprit}, not only tensors, numbers and strings: pfedkit never "
                "unpickles a run directory's files")
    first_line = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first_line[:160]}" if first_line else type(err).__name__


def check_data_file(path: str | Path, what: str, fix: str) -> None:
    """Refuse at once a `.pt` file that is missing, or not in the zip format torch.save writes (a
    truncated or empty file, a bare pickle), without reading its tensors."""
    path = Path(path)
    if not path.is_file():
        raise RunFileError(f"{path}: no such file (the {what}); {fix}")
    if not zipfile.is_zipfile(path):
        raise RunFileError(f"{path}: not a readable {what} (truncated, empty or another format); {fix}")


def read_arrays(path: str | Path, what: str, fix: str) -> dict[str, np.ndarray]:
    """Every array of an `.npz` file, read without unpickling (`allow_pickle=False`)."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as saved:
            return {name: saved[name] for name in saved.files}
    except FileNotFoundError:
        raise RunFileError(f"{path}: no such file (the {what}); {fix}") from None
    except ValueError as err:
        reason = "it holds Python objects (a pickle), not only arrays" if "allow_pickle" in str(err) else err
        raise RunFileError(f"{path}: not a readable {what} ({reason}); {fix}") from None
    except Exception as err:  # a truncated archive, a file of another kind
        raise RunFileError(f"{path}: not a readable {what} ({load_failure(err)}); {fix}") from None


def read_partition(path: str | Path, num_clients: int, num_rows: int, fix: str) -> tuple[list, list]:
    """partition.npz (`FederatedData.partition_arrays`): per client, its train and test rows,
    checked to be `num_clients` clients' integer rows of a dataset of `num_rows` rows."""
    arrays = read_arrays(path, "partition", fix)
    try:
        stored = int(arrays["num_clients"])
        if stored != num_clients:
            raise ValueError(f"it holds {stored} clients, the run has {num_clients}")
        train, test = ([_row_index(arrays, f"{split}_{cid}", num_rows) for cid in range(num_clients)]
                       for split in ("train", "test"))
    except (KeyError, ValueError, TypeError) as err:
        reason = f"no array {err}" if isinstance(err, KeyError) else err
        raise RunFileError(f"{path}: not the run's partition ({reason}); {fix}") from None
    return train, test


def _row_index(arrays: dict[str, np.ndarray], name: str, num_rows: int) -> np.ndarray:
    rows = arrays[name]
    if rows.ndim != 1 or rows.dtype.kind not in "iu" or (rows.size and not 0 <= rows.min() <= rows.max() < num_rows):
        raise ValueError(f"{name} is not a list of row numbers below the dataset's {num_rows}")
    return rows


DIAGNOSTICS = "diagnostics.pt"  # in a run directory: what the algorithm recorded (Algorithm.record)


def read_diagnostics(path: str | Path) -> dict:
    """A run's diagnostics.pt: {key: {round: value}} as `Algorithm.record` recorded them."""
    fix = "delete it to report the rest of the run"
    diagnostics = read_data(path, "diagnostics file", fix)
    if not isinstance(diagnostics, dict) or not all(isinstance(key, str) for key in diagnostics):
        raise RunFileError(f"{path}: not a diagnostics file (expected named diagnostics); {fix}")
    return diagnostics
