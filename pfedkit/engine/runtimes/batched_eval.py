"""Evaluation of many clients at once, for the `vectorized` runtime: the sequential evaluator's
`ClientEval`s without one small forward and two host syncs per client and batch.

How a list of `EvalItem`s is evaluated:
  * Every client's test rows are concatenated on the device once per run (the test pool; client
    c's rows start at `offsets[c]`), so any set of rows is one gather.
  * Items whose parameters are the very same tensors (`is`, for every name: FedAvg's global
    model, sent to everyone) form a group: ONE model, run over the concatenation of the group's
    test rows in batches of `rows` (8,192 on a GPU; `EVAL_BATCH` on the CPU, whose kernels want
    small batches in cache).
  * The other items (personalised models; on a GPU, or where `stack_personal` says so: on a CPU
    one client at a time is faster) go in chunks of similar test sizes: their parameters
    stacked [k, ...] (a tensor every client of the chunk holds is passed once), `k` bounded by a
    byte budget and by `rows`, so memory stays flat in the number of clients, and
    `vmap(functional_call)` runs them over [k, b] rows at a time, each client's rows padded to
    the slice with a mask. Clients are sorted by test size, so the clients still evaluating at a
    slice are a prefix of the chunk (views, no copies) and little is padded.
  * Each forward adds its per-sample cross-entropy (fp32, as `evaluate_logits_fn`) and hits into
    per-client sums with `index_add_` over the rows' owners (a padded row adds zero), class hits
    over owner * C + label; ONE device-to-host transfer at the end gives every `ClientEval`.
    Class totals are data: counted once per run on the host.

What goes to the per-client evaluator (`per_client`, the sequential runtime's, unchanged):
items with a custom `predict` (closures over algorithm state, evaluated on the host), items
with buffers, every item when the model has buffers (BatchNorm: eval uses the running
statistics, which each client holds apart), clients of another architecture (`batchable`), and
personalised models whose forward cannot run under vmap (one note per run).

Results equal the per-client evaluator's: hits and counts exactly (the same fp32 logits up to
rounding, so only a near-tie of two logits could differ), loss sums within float summation order
(~1e-6 relative; sums are accumulated in float64). A client with no test rows gets
ClientEval(0, 0, 0.0, zeros, zeros), as `evaluate_logits_fn` gives it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from pfedkit.core.params import Params
from pfedkit.data.federated import FederatedData
from pfedkit.engine.device import pooled_rows
from pfedkit.engine.protocols import EvalItem
from pfedkit.evaluation import EVAL_BATCH, ClientEval

ROWS_PER_FORWARD_GPU = 8192
STACK_BUDGET_BYTES = 256 * 2**20  # stacked parameters of one chunk of personalised models


class _Sums:
    """Per-client sums on the device, in slot order: loss (float64), hits, hits per class."""

    def __init__(self, slots: int, num_classes: int, device: torch.device) -> None:
        self.num_classes = num_classes
        self.loss = torch.zeros(slots, dtype=torch.float64, device=device)
        self.correct = torch.zeros(slots, dtype=torch.int64, device=device)
        self.class_correct = torch.zeros(slots * num_classes, dtype=torch.int64, device=device)

    def add(self, owner: torch.Tensor, y: torch.Tensor, logits: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Rows' statistics into their owners' sums; rows where `valid` is False add nothing."""
        logits = logits.float()
        loss = F.cross_entropy(logits, y, reduction="none")
        hits = logits.argmax(dim=1) == y
        if valid is not None:
            loss = torch.where(valid, loss, 0.0)
            hits = hits & valid
        hits = hits.long()
        self.loss.index_add_(0, owner, loss.double())
        self.correct.index_add_(0, owner, hits)
        self.class_correct.index_add_(0, owner * self.num_classes + y, hits)

    def to_host(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(loss sums, hits, hits per class [slots, C]) in one transfer (counts are exact in float64)."""
        both = torch.cat([self.loss, self.correct.double(), self.class_correct.double()]).cpu().numpy()
        slots = len(self.loss)
        return (both[:slots], both[slots:2 * slots].astype(np.int64),
                both[2 * slots:].astype(np.int64).reshape(slots, self.num_classes))


class BatchedEvaluator:
    """Evaluates `EvalItem`s of many clients in few large forwards (see module doc)."""

    def __init__(self, build: Callable[[], nn.Module], data: FederatedData, device: torch.device,
                 per_client: Callable[[list[EvalItem]], dict[int, ClientEval]],
                 batchable: Sequence[bool] | None = None, note: Callable[[str, str], None] | None = None,
                 rows: int | None = None, stack_bytes: int = STACK_BUDGET_BYTES,
                 stack_personal: bool | None = None) -> None:
        self.data, self.device, self.per_client = data, device, per_client
        # Personalised models stacked under vmap: on a GPU (one launch for many clients); on a CPU
        # one client at a time is faster (vmap's grouped convolutions: 5.2 s against 3.2 s for
        # 200 MNIST clients, FedAvgCNN, one thread), so None means "not on a CPU".
        self.stack_personal = device.type != "cpu" if stack_personal is None else stack_personal
        self.num_classes = data.num_classes
        self.batchable, self.note = batchable, note
        self.model = build().to(device).eval()  # a template: its own weights are never used
        self.names = [name for name, _ in self.model.named_parameters()]
        self.dtypes = {name: p.dtype for name, p in self.model.named_parameters()}
        self.model_has_buffers = any(True for _ in self.model.buffers())
        self.rows = rows or (EVAL_BATCH if device.type == "cpu" else ROWS_PER_FORWARD_GPU)
        param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.max_stack = max(1, stack_bytes // max(param_bytes, 1))
        self.vmap_error: str | None = None
        self.items_batched = 0  # counters for tests and diagnostics
        self.items_per_client = 0
        self._pool: tuple[torch.Tensor, torch.Tensor] | None = None  # see _test_pool
        self.offsets: list[int] = []
        self.class_totals = np.zeros((0, self.num_classes), dtype=np.int64)

    def evaluate(self, items: list[EvalItem]) -> dict[int, ClientEval]:
        """Each item's model on its client's test split (call under torch.inference_mode)."""
        batchable = [self._batchable(item) for item in items]
        batched = [item for item, ok in zip(items, batchable) if ok]
        results = self._evaluate_batched(batched) if batched else {}
        fallback = [item for item, ok in zip(items, batchable) if not ok or item[0] not in results]
        if fallback:
            results.update(self.per_client(fallback))
            self.items_per_client += len(fallback)
        return {cid: results[cid] for cid, *_ in items}

    def _batchable(self, item: EvalItem) -> bool:
        cid, _, buffers, predict = item
        return (predict is None and not buffers and not self.model_has_buffers
                and (self.batchable is None or self.batchable[cid]))

    def _evaluate_batched(self, items: list[EvalItem]) -> dict[int, ClientEval]:
        self._test_pool()
        sizes = [self.data.clients[cid].n_test for cid, *_ in items]
        groups: dict[tuple[int, ...], list[int]] = {}  # the same tensors -> slots (positions in items)
        for slot, (_, params, _, _) in enumerate(items):
            if sizes[slot]:
                groups.setdefault(tuple(id(params[name]) for name in self.names), []).append(slot)
        sums = _Sums(len(items), self.num_classes, self.device)
        distinct = [slots[0] for slots in groups.values() if len(slots) == 1]
        for slots in groups.values():
            if len(slots) > 1:
                self._evaluate_shared(items, slots, sums)
        failed: set[int] = set()
        if distinct:
            failed = self._evaluate_distinct(items, distinct, sizes, sums)
        loss, correct, class_correct = sums.to_host()
        out = {}
        for slot, (cid, *_) in enumerate(items):
            if slot in failed:
                continue
            out[cid] = ClientEval(int(correct[slot]), sizes[slot], float(loss[slot]), class_correct[slot].copy(),
                                  self.class_totals[cid].copy())
        self.items_batched += len(out)
        return out

    def _test_pool(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every client's test rows concatenated on the device once per run (client c's start at
        `offsets[c]`), and each client's test count per class on the host."""
        if self._pool is None:
            clients = self.data.clients
            ys = [client.y_test for client in clients]
            x, y, self.offsets = pooled_rows([client.x_test for client in clients], ys, self.device)
            self.class_totals = np.stack([torch.bincount(labels, minlength=self.num_classes).numpy()
                                          for labels in ys]).reshape(len(clients), self.num_classes)
            self._pool = (x, y)
        return self._pool

    def _on_device(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return tensor.detach().to(self.device, self.dtypes[name])

    def _evaluate_shared(self, items: list[EvalItem], slots: list[int], sums: _Sums) -> None:
        """One model over the concatenated test rows of the clients at `slots`."""
        x_pool, y_pool = self._pool
        params = items[slots[0]][1]
        params = {name: self._on_device(params[name], name) for name in self.names}
        cids = [items[slot][0] for slot in slots]
        counts = torch.tensor([self.data.clients[cid].n_test for cid in cids])
        starts = torch.tensor([self.offsets[cid] for cid in cids])
        owner = torch.repeat_interleave(torch.tensor(slots), counts)
        first = torch.repeat_interleave(starts - torch.cumsum(counts, 0) + counts, counts)
        rows = first + torch.arange(len(owner))  # pool row of each row of the concatenation
        rows, owner = torch.stack([rows, owner]).to(self.device)
        for start in range(0, len(rows), self.rows):
            batch = rows[start:start + self.rows]
            logits = functional_call(self.model, params, (x_pool[batch],))
            sums.add(owner[start:start + self.rows], y_pool[batch], logits, None)

    def _evaluate_distinct(self, items: list[EvalItem], slots: list[int], sizes: list[int], sums: _Sums) -> set[int]:
        """Personalised models, a chunk of similar test sizes at a time; the slots whose forward
        cannot run under vmap are returned (they go to the per-client evaluator)."""
        if self.vmap_error is not None or not self.stack_personal:
            return set(slots)
        slots = sorted(slots, key=lambda slot: -sizes[slot])
        start = 0
        try:
            while start < len(slots):
                width = min(sizes[slots[start]], self.rows)  # the chunk's rows per client and slice
                count = max(1, min(self.rows // width, self.max_stack, len(slots) - start))
                self._evaluate_chunk(items, slots[start:start + count], sizes, width, sums)
                start += count
        except Exception as err:  # the model's forward does not run under vmap
            self.vmap_error = f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
            if self.note is not None:
                self.note("eval-vmap", "evaluating personalised models one client at a time because their "
                                       f"forward cannot run under torch.vmap ({self.vmap_error})")
            return set(slots)
        return set()

    def _evaluate_chunk(self, items: list[EvalItem], slots: list[int], sizes: list[int], width: int,
                        sums: _Sums) -> None:
        """Clients at `slots` (by decreasing test size), [k, width] rows at a time: at each slice
        the clients that still have rows are a prefix of the chunk; rows past a client's end are
        padded (a copy of its last row) and masked."""
        x_pool, y_pool = self._pool
        batched, shared = self._stack([items[slot][1] for slot in slots])
        forward = vmap(self._forward, in_dims=(0, None, 0))
        counts = torch.tensor([sizes[slot] for slot in slots]).unsqueeze(1)  # [k, 1]
        starts = torch.tensor([self.offsets[items[slot][0]] for slot in slots]).unsqueeze(1)
        plan, rows, valid, owner = [], [], [], []
        for first in range(0, int(counts[0]), width):
            active = int((counts > first).sum())
            columns = first + torch.arange(width)  # [width]
            rows.append((starts[:active] + torch.minimum(columns, counts[:active] - 1)).reshape(-1))
            valid.append((columns < counts[:active]).reshape(-1))
            owner.append(torch.tensor(slots[:active]).repeat_interleave(width))
            plan.append(active)
        layout = torch.stack([torch.cat(rows), torch.cat(valid).long(), torch.cat(owner)]).to(self.device)
        position = 0
        for active in plan:
            stop = position + active * width
            batch, mask, who = layout[0, position:stop], layout[1, position:stop].bool(), layout[2, position:stop]
            params = {name: tensor[:active] for name, tensor in batched.items()}
            logits = forward(params, shared, x_pool[batch].view(active, width, *x_pool.shape[1:]))
            sums.add(who, y_pool[batch], logits.reshape(active * width, -1), mask)
            position = stop

    def _forward(self, batched: Params, shared: Params, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.model, {**shared, **batched}, (x,))

    def _stack(self, params: list[Params]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """[k, ...] per tensor on the device, stacked on the host (one transfer per tensor; from
        page-locked memory to a GPU); a tensor every client holds (a shared body) is passed once."""
        batched, shared = {}, {}
        for name in self.names:
            tensors = [client[name] for client in params]
            if all(t is tensors[0] for t in tensors):
                shared[name] = self._on_device(tensors[0], name)
            elif self.device.type == "cuda" and all(t.device.type == "cpu" and t.dtype == tensors[0].dtype for t in tensors):
                # stacked into page-locked memory: the copy runs at full speed, asynchronously (the
                # caching host allocator reuses the buffer only once its copy is done)
                staging = torch.empty((len(tensors), *tensors[0].shape), dtype=tensors[0].dtype, pin_memory=True)
                torch.stack([t.detach() for t in tensors], out=staging)
                batched[name] = staging.to(self.device, self.dtypes[name], non_blocking=True)
            elif len({t.device for t in tensors}) == 1:
                batched[name] = torch.stack([t.detach() for t in tensors]).to(self.device, self.dtypes[name])
            else:
                batched[name] = torch.stack([self._on_device(t, name) for t in tensors])
        return batched, shared

    def close(self) -> None:
        self._pool = None
