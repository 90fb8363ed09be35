"""How jobs and results travel between the main process and forked workers, cheaply.

Measured with 1,000 clients and no training at all, a job cost 17 ms:
- torch's own pickling moved every tensor into a new shared-memory segment and passed a file
  descriptor through a socket, per tensor and per job, although every FedAvg job carries the
  same global model;
- a 2.3 MB payload through the pool's pipe costs ~5 ms on this machine, each way.

Here tensors go through anonymous shared mappings created before the workers are forked (so
every worker sees them), and only small references go through the pipe:
- `WaveArena`: before a wave of jobs, the tensors that two or more jobs carry (the broadcast
  model) are written once; workers read them in place.
- `SlotRing`s: a fixed set of slots, one message each: the main process writes a job's own
  tensors (a client's model) into an inbox slot, the worker reads them in place and frees the
  slot when the job is done; the worker writes its result into an outbox slot, the main process
  copies it out and frees the slot. A full ring makes the writer wait (backpressure).
Whatever does not fit travels by value, as raw bytes in the pickle stream.

Layouts are kept (contiguous and channels_last tensors come back with the same strides), so
results are bit-identical to passing the tensors themselves.

Jobs and results are pickles, and unpickling runs whatever a pickle names: that is safe here
only because both ends are our own processes (the main process and the workers it forked or
spawned, through its own pipes and anonymous mappings). Nothing this module writes is stored,
and nothing read from a file or a network goes through it: run directories and Flower messages
have formats of their own that hold data only (pfedkit/run_files.py, pfedkit/flower/records.py).
"""
from __future__ import annotations

import dataclasses
import io
import mmap
import multiprocessing as mp
import pickle
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

ALIGN = 64  # bytes: every tensor written starts on a cache line


@dataclass(frozen=True)
class SharedRef:
    """Where a written tensor lies in a shared buffer, and how to view it."""
    buffer: str  # the name of the buffer in this process's registry
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    channels_last: bool
    requires_grad: bool
    generation: int | None = None  # WaveArena: the wave it was published in
    copy: bool = False  # the reader takes a copy (the slot is reused right after)


class SharedBuffer:
    """An anonymous shared mapping: written before fork or after, seen by parent and workers."""

    def __init__(self, name: str, nbytes: int) -> None:
        self.name = name
        self.nbytes = max(ALIGN, int(nbytes))
        self.mapping = mmap.mmap(-1, self.nbytes)
        self.bytes = torch.frombuffer(self.mapping, dtype=torch.uint8)

    def write(self, start: int, stop: int, tensors: Iterable[torch.Tensor], **ref_fields) -> dict[int, SharedRef]:
        """Pack `tensors` into bytes [start, stop); {id(tensor): ref} of those that fit."""
        refs, offset = {}, start
        for tensor in tensors:
            raw, channels_last = _storage_order(tensor)
            size = raw.numel() * raw.element_size()
            if offset + size > stop or id(tensor) in refs:
                continue  # travels by value instead (or is already written)
            self.bytes[offset:offset + size].copy_(_as_bytes(raw))
            refs[id(tensor)] = SharedRef(self.name, offset, tensor.dtype, tuple(tensor.shape), channels_last,
                                         tensor.requires_grad, **ref_fields)
            offset += -(-size // ALIGN) * ALIGN
        return refs

    def view(self, ref: SharedRef) -> torch.Tensor:
        return _from_bytes(self.bytes, ref.offset, ref.dtype, ref.shape, ref.channels_last, ref.requires_grad)


class WaveArena(SharedBuffer):
    """The tensors shared by a wave's jobs. Its first cache line holds the number of the wave
    published last, so that reading a reference of an older wave fails loudly."""

    def __init__(self, name: str, nbytes: int) -> None:
        super().__init__(name, ALIGN + nbytes)
        self.header = self.bytes[:8].view(torch.int64)

    def publish(self, tensors: Iterable[torch.Tensor]) -> dict[int, SharedRef]:
        """Write `tensors` (replacing the last wave's): call only when no worker still reads them."""
        generation = int(self.header[0]) + 1
        self.header[0] = generation
        return self.write(ALIGN, self.nbytes, tensors, generation=generation)

    def view(self, ref: SharedRef) -> torch.Tensor:
        current = int(self.header[0])
        if ref.generation != current:
            raise RuntimeError(f"a shared tensor of wave {ref.generation} was read during wave {current}")
        return super().view(ref)


class SlotRing(SharedBuffer):
    """`count` slots of `slot_bytes`; a writer takes a free slot (waiting while none is), the
    reader frees it. The free list lives in shared memory behind a lock; a semaphore counts the
    free slots."""

    def __init__(self, name: str, count: int, slot_bytes: int) -> None:
        self.slot_bytes = -(-int(slot_bytes) // ALIGN) * ALIGN
        super().__init__(name, count * self.slot_bytes)
        self.count = count
        self.taken = mp.get_context("fork").Array("b", count, lock=True)
        self.free = mp.get_context("fork").Semaphore(count)

    def acquire(self, cancelled: Callable[[], bool] = lambda: False) -> int:
        while not self.free.acquire(timeout=0.2):
            if cancelled():
                raise RuntimeError(f"{self.name}: gave up waiting for a free slot (the stream was abandoned)")
        with self.taken.get_lock():
            slot = list(self.taken[:]).index(0)
            self.taken[slot] = 1
        return slot

    def release(self, slot: int) -> None:
        with self.taken.get_lock():
            self.taken[slot] = 0
        self.free.release()

    def write_slot(self, slot: int, tensors: Iterable[torch.Tensor], copy: bool) -> dict[int, SharedRef]:
        start = slot * self.slot_bytes
        return self.write(start, start + self.slot_bytes, tensors, copy=copy)


# The shared buffers this process knows, by name (workers inherit them through fork).
_BUFFERS: dict[str, SharedBuffer] = {}


def register(*buffers: SharedBuffer) -> None:
    for buffer in buffers:
        _BUFFERS[buffer.name] = buffer


def unregister(*buffers: SharedBuffer) -> None:
    for buffer in buffers:
        _BUFFERS.pop(buffer.name, None)


def _shared_tensor(ref: SharedRef) -> torch.Tensor:
    view = _BUFFERS[ref.buffer].view(ref)
    return view.detach().clone().requires_grad_(ref.requires_grad) if ref.copy else view


def _tensor_from_buffer(buffer, dtype: torch.dtype, shape: tuple[int, ...], channels_last: bool,
                        requires_grad: bool) -> torch.Tensor:
    source = torch.frombuffer(buffer, dtype=torch.uint8) if len(buffer) else torch.empty(0, dtype=torch.uint8)
    return _from_bytes(source, 0, dtype, shape, channels_last, requires_grad)


class _Pickler(pickle.Pickler):
    def __init__(self, file, refs: dict[int, SharedRef]) -> None:
        super().__init__(file, protocol=5)
        self.refs = refs

    def reducer_override(self, obj: Any):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.device.type != "cpu" or obj.is_sparse:
            return NotImplemented
        ref = self.refs.get(id(obj))
        if ref is not None:
            return _shared_tensor, (ref,)
        raw, channels_last = _storage_order(obj.detach())
        buffer = pickle.PickleBuffer(_as_bytes(raw).numpy()) if raw.numel() else bytearray()
        return _tensor_from_buffer, (buffer, obj.dtype, tuple(obj.shape), channels_last, obj.requires_grad)


def dumps(obj: Any, refs: dict[int, SharedRef] | None = None) -> bytes:
    """Pickle `obj`: tensors in `refs` as references into shared buffers, every other CPU tensor
    as its raw bytes."""
    stream = io.BytesIO()
    _Pickler(stream, refs or {}).dump(obj)
    return stream.getvalue()


def loads(data: bytes) -> Any:
    """Unpickle what `dumps` made in one of our own processes (module docstring): never data
    from a file or a network."""
    return pickle.loads(data)


def tensors_in(value: Any) -> Iterable[torch.Tensor]:
    """Every tensor inside nested dicts, lists, tuples and dataclass instances."""
    if isinstance(value, torch.Tensor):
        yield value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from tensors_in(getattr(value, field.name))
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)


def shared_tensors(payloads: Iterable[Any]) -> list[torch.Tensor]:
    """The CPU tensors that appear in two or more of `payloads` (by identity), first seen first."""
    seen: dict[int, tuple[torch.Tensor, int]] = {}
    for payload in payloads:
        for tensor in {id(t): t for t in tensors_in(payload)}.values():
            first, count = seen.get(id(tensor), (tensor, 0))
            seen[id(tensor)] = (first, count + 1)
    return [tensor for tensor, count in seen.values() if count > 1 and tensor.device.type == "cpu"]


def _storage_order(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(a contiguous tensor holding `tensor`'s values in memory order, whether it was channels_last)."""
    if tensor.dim() == 4 and not tensor.is_contiguous() and tensor.is_contiguous(memory_format=torch.channels_last):
        return tensor.permute(0, 2, 3, 1), True  # NHWC order, contiguous
    return tensor.contiguous(), False


def _as_bytes(raw: torch.Tensor) -> torch.Tensor:
    return raw.detach().reshape(-1).view(torch.uint8)


def _from_bytes(source: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...],
                channels_last: bool, requires_grad: bool) -> torch.Tensor:
    numel = 1
    for size in shape:
        numel *= size
    flat = source[offset:offset + numel * torch.empty((), dtype=dtype).element_size()].view(dtype)
    if channels_last:
        n, c, h, w = shape
        tensor = flat.view(n, h, w, c).permute(0, 3, 1, 2)
    else:
        tensor = flat.view(shape)
    return tensor.requires_grad_(True) if requires_grad else tensor
