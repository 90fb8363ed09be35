"""The lock-step of the `vectorized` runtime: one chunk of a group's clients stacked on the device
(`ChunkTensors`), the plan of its mini-batch steps (`step_plan`), and one stacked SGD step run
eagerly or replayed from a CUDA graph captured once per step shape (`StepShapes`).

Shapes. A step's shape is (members k, batch size b). Eagerly, any shape runs as it comes, and
members that form a contiguous range of the stack are trained through views (no copies). With
CUDA graphs each shape is captured once and replayed, so the shapes must repeat: k is padded up to
the next power of two, or beyond 256 the next multiple of 256 (at most the chunk's capacity), with
*sink* members. A sink member points at the extra last row of every stacked tensor (row
`capacity`), trains on row 0 of the pool and writes only to that row; vmap computes each member on
its own, so no client's numbers depend on the sinks.
Batch sizes are never padded: the last, smaller batch of an epoch is a shape of its own, so no loss
is masked and every loss computes exactly what it computes sequentially. A chunk of capacity C with
batch size B thus captures at most (9 + C / 256) x B graphs, once for the run (the chunk's tensors
are reused, round after round, at the addresses the graphs captured).

The step itself: the members' rows are selected (views for a contiguous range, else
`index_select`), `vmap(grad_and_value(loss))` gives their gradients and losses, torch.optim.SGD's
update (`stacked_sgd_step`) is applied, and the rows are written back (`index_copy_`) with each
member's loss summed into `totals`. Everything a graph reads between replays sits in static
buffers: the member index and the pool and batch rows of the shape, copied in before each replay.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from pfedkit.engine.trainer import TrainSettings


FINE_ABOVE = 256  # members beyond this round up to a multiple of it, not to a power of two


def member_bucket(k: int, capacity: int) -> int:
    """Members of a graphed step: k rounded up to a power of two up to FINE_ABOVE, to a multiple of
    FINE_ABOVE beyond (at most 1/2 of sink work below it, at most FINE_ABOVE - 1 sinks above), at
    most `capacity`."""
    if k > FINE_ABOVE:
        return min(-(-k // FINE_ABOVE) * FINE_ABOVE, capacity)
    return min(1 << max(k - 1, 0).bit_length(), capacity)


def chunk_capacity(k: int, max_clients: int) -> int:
    """Rows of a chunk's stacked tensors: k rounded up to a power of two, at most `max_clients`, so
    that rounds with a few clients more or less (and a run's last, smaller chunk) reuse the same
    tensors and graphs."""
    return min(1 << max(k - 1, 0).bit_length(), max_clients)


def stack_rows(tensors: Sequence[torch.Tensor], capacity: int, device: torch.device, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """[capacity + 1, ...] on `device`: rows 0..k-1 the clients' tensors, the others zero (unused
    rows and the sink) when new; written into `out` when given (graphs keep their addresses). The
    very same tensor for every client (the global model FedAvg sends) crosses to the device once."""
    first = tensors[0]
    k = len(tensors)
    if out is None:  # rows 0..k-1 are written below: only the others are zeroed (each page touched once)
        out = torch.empty((capacity + 1, *first.shape), dtype=dtype, device=device)
        out[k:].zero_()
    if all(t is first for t in tensors):
        one = first.detach().to(device, dtype)
        out[:k].copy_(one.unsqueeze(0).expand(k, *one.shape))
    elif device.type != "cpu" and all(t.device.type == "cpu" for t in tensors):
        out[:k].copy_(torch.stack([t.detach() for t in tensors]))  # one host-to-device transfer
    else:
        for row, tensor in enumerate(tensors):
            out[row].copy_(tensor.detach())
    return out


class Stacked:
    """Tensors of a chunk by name or leaf position: stacked [capacity + 1, ...] where clients differ
    (`batched`), passed once (`shared`, vmap in_dims None) where every client holds the very same
    tensor. `into`: a kept Stacked of the same layout (`stacked_layout`), whose tensors take the
    values in place (graphs keep their addresses) instead of new ones being allocated."""

    def __init__(self, per_client: list[dict[Any, torch.Tensor]], capacity: int, device: torch.device,
                 dtypes: dict[Any, torch.dtype] | None = None, into: Stacked | None = None) -> None:
        self.batched: dict[Any, torch.Tensor] = {}
        self.shared: dict[Any, torch.Tensor] = {}
        for key in per_client[0]:
            tensors = [values[key] for values in per_client]
            dtype = dtypes[key] if dtypes else tensors[0].dtype
            if all(t is tensors[0] for t in tensors):
                # A copy even on the CPU: a reused chunk's buffers are written in later rounds,
                # and this one must not be the caller's tensor (a global model, an anchor).
                if into is None:
                    self.shared[key] = tensors[0].detach().to(device, dtype, copy=True)
                else:
                    self.shared[key] = into.shared[key].copy_(tensors[0].detach())
            else:
                self.batched[key] = stack_rows(tensors, capacity, device, dtype,
                                               None if into is None else into.batched[key])

    def layout(self) -> tuple:
        """What a captured graph depends on: which keys are stacked and which are shared."""
        return _layout(self.batched, self.shared)


def stacked_layout(per_client: list[dict[Any, torch.Tensor]]) -> tuple:
    """The layout a `Stacked` of these tensors will have, found without stacking anything."""
    first = per_client[0]
    shared = [key for key in first if all(values[key] is first[key] for values in per_client)]
    return _layout([key for key in first if key not in shared], shared)


def chunk_layout(capacity: int, trainable, momentum, frozen: tuple, context: tuple) -> tuple:
    """What a chunk's captured graphs depend on: its capacity, the names of its trainable tensors
    and momentum buffers, and the layouts of its frozen and context tensors (`Stacked.layout`)."""
    return capacity, tuple(trainable), tuple(momentum), frozen, context


def _layout(batched, shared) -> tuple:
    return tuple(sorted(map(repr, batched))), tuple(sorted(map(repr, shared)))


class ChunkTensors:
    """The device tensors of one chunk of a group: trainable parameters and momentum stacked,
    frozen parameters and context tensors stacked or shared, the summed losses per member; rows
    0..k-1 are the chunk's clients, row `capacity` the sink."""

    def __init__(self, params: dict[str, torch.Tensor], momentum: dict[str, torch.Tensor], frozen: Stacked,
                 context: Stacked, capacity: int, k: int) -> None:
        self.params, self.momentum, self.frozen, self.context = params, momentum, frozen, context
        self.capacity, self.k = capacity, k
        device = next(iter(params.values())).device if params else torch.device("cpu")
        self.totals = torch.zeros(capacity + 1, dtype=torch.float64, device=device)

    def layout(self) -> tuple:
        return chunk_layout(self.capacity, self.params, self.momentum, self.frozen.layout(), self.context.layout())

    def restart(self, k: int) -> None:
        """This chunk now holds `k` new clients (their values written in place): no losses summed yet."""
        self.k = k
        self.totals.zero_()


@torch.no_grad()
def stacked_sgd_step(settings: TrainSettings, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor],
                     momentum: dict[str, torch.Tensor], lr: float) -> None:
    """torch.optim.SGD(foreach) after clip_grad_norm_, in place on [k, ...] tensors, k clients at
    once: per-client gradient-norm clipping over the client's trainable tensors, weight decay,
    momentum (a zero buffer gives the first step's `buf = grad` exactly), the step."""
    s = settings
    names = list(params)
    weights = [params[n] for n in names]
    updates = [grads[n] for n in names]
    if s.grad_clip is not None:
        k = weights[0].shape[0]
        norms = torch.stack([torch.linalg.vector_norm(g.reshape(k, -1), dim=1) for g in updates])  # [T, k]
        total = torch.linalg.vector_norm(norms, dim=0)
        scale = torch.clamp(s.grad_clip / (total + 1e-6), max=1.0)
        updates = [g * scale.view(k, *([1] * (g.dim() - 1))) for g in updates]
    if s.weight_decay != 0:
        updates = torch._foreach_add(updates, weights, alpha=s.weight_decay)
    if s.momentum != 0:
        buffers = [momentum[n] for n in names]
        torch._foreach_mul_(buffers, s.momentum)
        torch._foreach_add_(buffers, updates, alpha=1)  # dampening 0; zero buffer: first buf = grad
        updates = buffers
    torch._foreach_add_(weights, updates, alpha=-lr)


def train_members(step: Callable, update: Callable, chunk: ChunkTensors, pool: tuple[torch.Tensor, torch.Tensor],
                  members: slice | torch.Tensor, pool_rows: torch.Tensor, rows: torch.Tensor) -> None:
    """One SGD step of `members` of the chunk (a slice: views, updated in place; an index tensor:
    copies, written back) on the pool rows `pool_rows` ([k, B]; `rows`: the same samples'
    positions in each client's training set, for `Forward.index`)."""
    if isinstance(members, slice):
        take = lambda tensors: {n: v[members] for n, v in tensors.items()}  # noqa: E731
    else:
        take = lambda tensors: {n: v.index_select(0, members) for n, v in tensors.items()}  # noqa: E731
    x_all, y_all = pool
    params, momentum = take(chunk.params), take(chunk.momentum)
    grads, loss = step(params, take(chunk.frozen.batched), chunk.frozen.shared, x_all[pool_rows], y_all[pool_rows],
                       rows, take(chunk.context.batched), chunk.context.shared)
    update(params, grads, momentum)
    if isinstance(members, slice):
        chunk.totals[members] += loss.double()
        return
    for part, updated in ((chunk.params, params), (chunk.momentum, momentum)):
        for n, tensor in updated.items():
            part[n].index_copy_(0, members, tensor)
    chunk.totals.index_add_(0, members, loss.double())


PlanStep = tuple[slice | torch.Tensor, torch.Tensor, torch.Tensor]  # (members, pool rows, batch rows)


def step_plan(schedules: list[list[torch.Tensor]], pool_offsets: list[int], device: torch.device,
              pad_to: Callable[[int], int] | None, sink: int) -> list[PlanStep]:
    """The chunk's steps in order: per mini-batch step t, one entry per batch size present among
    the members still training at t: (members, [k, B] pool rows, [k, B] rows of each client's
    training set). `pad_to(k)`: the padded member count (graphs), the extra members being the sink
    on pool row 0; None: exact members, a contiguous range given as a slice. Built on the host
    (array operations: a round of 100 clients has ~25,000 client-steps) and moved to the device in
    one transfer."""
    lengths = np.array([len(schedule) for schedule in schedules], dtype=np.int64)
    if lengths.sum() == 0:
        return []
    member = np.repeat(np.arange(len(schedules)), lengths)                # one entry per (client, step)
    step = np.concatenate([np.arange(n) for n in lengths])
    size = np.array([batch.shape[0] for schedule in schedules for batch in schedule], dtype=np.int64)
    first_row = np.concatenate([[0], np.cumsum(size)[:-1]])
    flat_rows = torch.cat([batch for schedule in schedules for batch in schedule]).numpy()
    order = np.lexsort((member, -size, step))                             # by step, batch size, member
    member, step, size, first_row = member[order], step[order], size[order], first_row[order]
    cuts = np.flatnonzero((np.diff(step) != 0) | (np.diff(size) != 0)) + 1
    offsets = np.zeros(sink + 1, dtype=np.int64)                          # the sink reads pool row 0
    offsets[:len(pool_offsets)] = pool_offsets
    layout, indices, local, pooled = [], [], [], []
    for lo, hi in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [len(member)]])):
        members, width = member[lo:hi], int(size[lo])
        padded = pad_to(len(members)) if pad_to else len(members)
        rows = flat_rows[first_row[lo:hi, None] + np.arange(width)]       # [k, B]
        rows = np.concatenate([rows, np.zeros((padded - len(members), width), dtype=rows.dtype)])
        index = np.concatenate([members, np.full(padded - len(members), sink)])
        layout.append((members, padded, width))
        indices.append(index)
        local.append(rows.reshape(-1))
        pooled.append((rows + offsets[index][:, None]).reshape(-1))
    both = torch.from_numpy(np.stack([np.concatenate(local), np.concatenate(pooled)])).to(device)
    index_all = torch.from_numpy(np.concatenate(indices)).to(device)
    plan, start_m, start_r = [], 0, 0
    for members, padded, width in layout:
        stop_r = start_r + padded * width
        contiguous = pad_to is None and members[-1] - members[0] + 1 == len(members)
        selected = slice(int(members[0]), int(members[-1]) + 1) if contiguous else index_all[start_m:start_m + padded]
        pool_rows, rows = both[1, start_r:stop_r].view(padded, width), both[0, start_r:stop_r].view(padded, width)
        plan.append((selected, pool_rows, rows))
        start_m, start_r = start_m + padded, stop_r
    return plan


class StepShapes:
    """The chunk's step, captured as one CUDA graph per shape (members, batch size) and replayed:
    each call copies its member index and rows into the shape's static buffers, then replays. On a
    device without graphs (`graphs=False`) the same buffers are filled and the step runs eagerly,
    which is how the CPU tests check this protocol."""

    def __init__(self, run_step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None], sink: int,
                 device: torch.device, graphs: bool, note: Callable[[str], None] = print) -> None:
        self.run_step, self.sink, self.device, self.graphs, self.note = run_step, sink, device, graphs, note
        self.shapes: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]] = {}
        self.pool = torch.cuda.graph_pool_handle() if graphs else None
        self.captured = 0

    def __call__(self, members: torch.Tensor, pool_rows: torch.Tensor, rows: torch.Tensor) -> None:
        shape = tuple(pool_rows.shape)
        if shape not in self.shapes:
            self.shapes[shape] = self._prepare(*shape)
        index, pool_buffer, rows_buffer, graph = self.shapes[shape]
        index.copy_(members)
        pool_buffer.copy_(pool_rows)
        rows_buffer.copy_(rows)
        if graph is None:
            self.run_step(index, pool_buffer, rows_buffer)
        else:
            graph.replay()

    def _prepare(self, k: int, size: int):
        index = torch.full((k,), self.sink, dtype=torch.long, device=self.device)  # every member a sink
        pool_buffer = torch.zeros((k, size), dtype=torch.long, device=self.device)
        rows_buffer = torch.zeros((k, size), dtype=torch.long, device=self.device)
        graph = None
        if self.graphs:
            # Warm-up on a side stream (lazy initialisations must not happen during capture), on
            # sink members only: the clients' rows are untouched until the first replay.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.run_step(index, pool_buffer, rows_buffer)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = self._capture(index, pool_buffer, rows_buffer)
        return index, pool_buffer, rows_buffer, graph

    def _capture(self, *buffers: torch.Tensor) -> Any:
        """The shape's graph, or None (the shape then runs eagerly) where something in the step
        cannot be captured (a host sync or a host-to-device copy inside the loss, say)."""
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                self.run_step(*buffers)
        except Exception as err:  # noqa: BLE001 - whatever the capture refused
            torch.cuda.synchronize(self.device)
            self.note(f"a step could not be captured as a CUDA graph ({type(err).__name__}: "
                      f"{' '.join(str(err).split())[:200]}); its shapes run eagerly")
            self.graphs = False
            return None
        self.captured += 1
        return graph
