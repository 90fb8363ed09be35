"""Algorithm messages and states <-> Flower records, exactly (same values, dtypes and types).

pfedkit's messages and states are nested Python values: dicts (keys may be ints), lists, tuples,
tensors, numpy arrays and scalars, numbers, strings, None. Flower ships `RecordDict`s of
`ArrayRecord` (named arrays) and `ConfigRecord` (flat scalars). `pack` puts every tensor and
array of a value into one ArrayRecord and describes the rest, with a reference for each array,
in a JSON skeleton; `unpack` rebuilds the value. No pickle travels: a node only ever decodes
arrays and JSON, and so does the server. Flower decodes an Array with `np.load(allow_pickle=False)`;
`take` and `unpack` accept only what `put` writes (an ArrayRecord of numpy arrays, a ConfigRecord
holding one JSON text, skeleton nodes of the kinds below, numpy scalars of numeric dtypes) and
refuse anything else with one `RecordError` line, in either direction.

Round trips are exact, so the bytes the engine counts (`message_bytes`) and every number computed
from a decoded message are those of the in-process simulation: bfloat16 tensors (which Flower's
arrays cannot hold) travel as float32 and come back as bfloat16, channels_last tensors come back
channels_last, numpy scalars keep their dtype.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

try:  # the optional `flower` extra
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("pfedkit.flower needs Flower: pip install -e '.[flower]'") from err

_SKELETON = "skeleton"
_SCALAR_KINDS = "biufc"  # numpy scalars a record may carry: bool, integers, floats, complex


class RecordError(ValueError):
    """A received message entry that is not what `put` writes; one line."""


def pack(value: Any) -> tuple[ArrayRecord, str]:
    """(every array of `value` by reference key, the JSON skeleton of `value`)."""
    arrays: dict[str, torch.Tensor] = {}
    skeleton = json.dumps(_encode(value, arrays), allow_nan=True)
    return ArrayRecord(arrays), skeleton


def unpack(arrays: ArrayRecord, skeleton: str, name: str = "payload") -> Any:
    """The value `pack` packed; RecordError for anything `pack` does not make."""
    if not isinstance(arrays, ArrayRecord) or not isinstance(skeleton, str):
        raise RecordError(f"message entry {name}: arrays of type {type(arrays).__name__} and a skeleton of type "
                          f"{type(skeleton).__name__}, expected an ArrayRecord and JSON text; only pfedkit's records "
                          "are accepted")
    try:
        tensors = arrays.to_torch_state_dict() if len(arrays) else {}
        return _decode(json.loads(skeleton), tensors)
    except (TypeError, ValueError, KeyError, RecursionError) as err:
        reason = " ".join(str(err).split())[:200]
        raise RecordError(f"message entry {name}: not a pfedkit record ({type(err).__name__}: {reason}); only "
                          "numpy arrays and a JSON skeleton of dicts, lists, numbers and strings are accepted") from None


def put(record: RecordDict, name: str, value: Any) -> None:
    """Store `value` in `record` under `name` (two entries: `name.arrays`, `name.meta`)."""
    put_packed(record, name, pack(value))


def put_packed(record: RecordDict, name: str, packed: tuple[ArrayRecord, str]) -> None:
    """`put` for a value already packed (one encoding sent in many messages)."""
    record[f"{name}.arrays"], record[f"{name}.meta"] = packed[0], ConfigRecord({_SKELETON: packed[1]})


def take(record: RecordDict, name: str, default: Any = None) -> Any:
    """The value `put` stored under `name`; `default` when there is none."""
    if f"{name}.meta" not in record:
        return default
    meta = record[f"{name}.meta"]
    if not isinstance(meta, ConfigRecord) or list(meta) != [_SKELETON]:
        raise RecordError(f"message entry {name}.meta: expected a ConfigRecord holding only {_SKELETON!r}")
    return unpack(record[f"{name}.arrays"] if f"{name}.arrays" in record else None, meta[_SKELETON], name)


def _encode(value: Any, arrays: dict[str, torch.Tensor]) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, torch.Tensor):
        return _encode_tensor(value, arrays)
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise TypeError("cannot send a numpy array of Python objects in a Flower record")
        key = str(len(arrays))
        arrays[key] = torch.from_numpy(np.ascontiguousarray(value))
        return {"t": "ndarray", "k": key}
    if isinstance(value, np.generic):
        return {"t": "npscalar", "dtype": value.dtype.str, "v": value.item()}
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, dict):
        return {"t": "dict", "items": [[_encode(k, arrays), _encode(v, arrays)] for k, v in value.items()]}
    if isinstance(value, list):
        return [_encode(item, arrays) for item in value]
    if isinstance(value, tuple):
        return {"t": "tuple", "v": [_encode(item, arrays) for item in value]}
    raise TypeError(f"cannot send a {type(value).__name__} in a Flower record: messages and states must be "
                    "dicts, lists, tuples, tensors, numpy arrays, numbers, strings or None")


def _encode_tensor(tensor: torch.Tensor, arrays: dict[str, torch.Tensor]) -> dict[str, Any]:
    key = str(len(arrays))
    node: dict[str, Any] = {"t": "tensor", "k": key}
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:  # Flower's arrays go through numpy, which has no bfloat16
        node["dtype"] = "bfloat16"
        tensor = tensor.float()
    if tensor.dim() == 4 and not tensor.is_contiguous() and tensor.is_contiguous(memory_format=torch.channels_last):
        node["channels_last"] = True
    arrays[key] = tensor.contiguous()
    return node


def _decode(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, list):
        return [_decode(item, tensors) for item in node]
    if not isinstance(node, dict):
        return node
    kind = node["t"]
    if kind == "tensor":
        tensor = tensors[node["k"]]  # to_torch_state_dict made fresh, writable tensors
        if node.get("dtype") == "bfloat16":
            tensor = tensor.to(torch.bfloat16)
        return tensor.contiguous(memory_format=torch.channels_last) if node.get("channels_last") else tensor
    if kind == "ndarray":
        return tensors[node["k"]].numpy().copy()
    if kind == "npscalar":
        dtype = np.dtype(node["dtype"])
        if dtype.kind not in _SCALAR_KINDS:
            raise ValueError(f"a numpy scalar of dtype {dtype}")
        return dtype.type(node["v"])
    if kind == "tuple":
        return tuple(_decode(item, tensors) for item in node["v"])
    if kind == "dict":
        return {_hashable(_decode(k, tensors)): _decode(v, tensors) for k, v in node["items"]}
    raise ValueError(f"unknown record node {kind!r}")


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key
