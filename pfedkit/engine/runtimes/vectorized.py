"""`vectorized` backend: the pending `Fit` requests of a step trained together, as one batched
computation (torch.func), with the sequential trainer's results.

How a step's requests are trained:
  * Requests are grouped when one function can train them all: the same loss (a `partial` counts
    as the same when its function, arguments and keywords are equal), the same trainable part,
    the same learning rate and contexts of the same structure (same keys, tensor shapes and
    dtypes, equal non-tensor values). Epochs and steps may differ inside a group: every client
    simply runs its own number of mini-batches.
  * A group's parameters are stacked ([K, ...] per tensor). Each client's mini-batch indices come
    from the same generator as in `LocalTrainer` (seeded by (seed, round, client, `FitJob.seed_tag`)),
    so every client sees exactly the batches it would see sequentially.
  * At mini-batch step t, the clients that still have a batch are split by the size of that batch
    (the last batch of an epoch is usually smaller) and each split is one call of
    `vmap(grad_and_value(loss))` over (parameters, x batch, y batch, context), where the loss is
    `request.loss(Forward(features, logits), y, params, context)` with features and logits from
    `functional_call` on the model's body and head. Clients with no batch left are skipped.
  * The SGD update repeats torch.optim.SGD (foreach) on the stacked tensors: per-client gradient
    norm clipping as `clip_grad_norm_` (the norm over the client's trainable tensors), then
    weight decay, momentum (a zero buffer gives the first step's `buf = grad` exactly) and the
    step. Frozen parts (trainable "body" / "head") get no update, as in the optimiser.
  * Context tensors and frozen parameters that are the very same tensor for every client of a
    group (FedProx's anchor, FedAvg's frozen part) are passed once, not stacked.
  * Chunks: at most `max_clients` consecutive clients (in client order) train together; a chunk's
    results are handed on before the next chunk trains, so memory is flat in the number of clients.
  * How each step runs (`vectorized.step`, engine/runtimes/lockstep.py): `graphs` captures one
    CUDA graph per (members, batch size) shape and replays it (members padded to powers of two with
    a sink row; batch sizes never padded, so no loss is masked), with the stacked tensors reused
    round after round at the captured addresses; `bucketed` runs the same shapes eagerly (the
    CPU twin the tests compare); `eager` runs the exact shapes, contiguous members as views.
    `auto`: graphs on a GPU in fp32 without dropout, else eager.

What falls back to `LocalTrainer` (one message per reason and run):
  * models with buffers (BatchNorm running statistics): vmap training does not update them per
    client the way the module does in train mode;
  * a group whose loss cannot run under vmap (data-dependent Python control flow such as
    `if tensor.any():`, boolean-mask indexing, `.item()`): the whole group is re-run sequentially
    (nothing is written before a group finishes, so the retry starts from the same inputs).

Results equal the sequential backend's up to float rounding (batched matmuls and reductions sum
in a different order): parameters agree to ~1e-7 after a few rounds on small models. Models
with dropout are vectorized too (vmap randomness="different"), with a note: the sequential
trainer draws its masks from torch's global RNG in client order, so no runtime can reproduce
them; such runs agree in distribution only. bf16 runs under autocast inside vmap.

Device: the run's `device` (one line says which; see engine/device.py). Fallbacks run the
sequential trainer on the same device. Evaluation is batched across clients
(runtimes/batched_eval.py: one forward per shared model, vmap over personalised ones), with the
sequential evaluator for what it cannot take (custom `predict`, on the host; buffers; other
architectures).
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from pfedkit.core.contract import Forward
from pfedkit.core.params import unprefixed
from pfedkit.core.seeds import torch_generator
from pfedkit.core.threads import thread_count
from pfedkit.data.federated import FederatedData
from pfedkit.engine.device import describe_device, pooled_rows
from pfedkit.engine.protocols import EvalItem
from pfedkit.engine.runtimes.batched_eval import BatchedEvaluator
from pfedkit.engine.runtimes.lockstep import (ChunkTensors, Stacked, StepShapes, chunk_capacity, chunk_layout,
                                               member_bucket, stack_rows, stacked_layout, stacked_sgd_step,
                                               step_plan, train_members)
from pfedkit.engine.runtimes.sequential import SequentialRuntime
from pfedkit.engine.trainer import (FitJob, FitOutcome, TrainSettings, batch_schedule, precision_context,
                                    request_lr)
from pfedkit.evaluation import ClientEval


STEP_KINDS = ("auto", "eager", "bucketed", "graphs")
WORKSPACES = 4  # kinds of group (loss, layout, capacity) whose stacked tensors and graphs are kept
MEMORY_SHARE = 0.25  # of the device's memory (a GPU's total, the host's available) for one chunk's tensors
MAX_CLIENTS_CAP = 4096


def step_kind(requested: str, device: torch.device, precision: str, dropout: list[str]) -> str:
    """How each lock-step runs: `graphs` (CUDA graphs, one per shape), `bucketed` (the same padded
    shapes and static buffers, run eagerly: the graphs' twin on a CPU), or `eager` (exact shapes,
    contiguous members as views). auto: graphs on a GPU in fp32 without dropout, else eager (bf16
    autocast caches casts, which a graph cannot; dropout's random masks are left to eager mode)."""
    if requested not in STEP_KINDS:
        raise ValueError(f"vectorized.step: {requested!r} is not one of {', '.join(STEP_KINDS)}")
    if requested == "graphs" and device.type != "cuda":
        raise ValueError(f"vectorized.step=graphs needs a CUDA device; this run trains on {device.type}")
    if requested != "auto":
        return requested
    return "graphs" if device.type == "cuda" and precision == "fp32" and not dropout else "eager"


def default_max_clients(model: nn.Module, device: torch.device) -> int:
    """Clients trained together at most: a power of two whose stacked tensors (parameters, their
    gradients, momentum and the selected copies: ~4 models a client) fit in MEMORY_SHARE of the
    device's memory, between 1 and MAX_CLIENTS_CAP."""
    per_client = 4 * sum(p.numel() * p.element_size() for p in model.parameters())
    if device.type == "cuda":
        budget = torch.cuda.get_device_properties(device).total_memory * MEMORY_SHARE
    else:
        budget = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * MEMORY_SHARE
    fit = max(1, int(budget // max(per_client, 1)))
    return min(1 << (fit.bit_length() - 1), MAX_CLIENTS_CAP)


def model_blocker(model: nn.Module) -> str | None:
    """Why this model cannot be trained under vmap with the sequential results, or None."""
    buffers = [name for name, _ in model.named_buffers()]
    if buffers:
        shown = ", ".join(buffers[:3]) + (", ..." if len(buffers) > 3 else "")
        return (f"the model has buffers ({shown}; e.g. BatchNorm running statistics), which vmap "
                "training does not update per client")
    return None


def dropout_layers(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, nn.modules.dropout._DropoutNd)]


def loss_key(loss: Callable) -> Any:
    """A comparable description of a loss: partials compare by function, args and keywords."""
    if isinstance(loss, functools.partial):
        return ("partial", loss_key(loss.func), loss.args, tuple(sorted(loss.keywords.items())))
    return loss


def same(a: Any, b: Any) -> bool:
    """a == b as a bool; False where the comparison is not a plain truth value (tensors, arrays)."""
    try:
        return bool(a == b)
    except Exception:  # ambiguous truth values of tensors/arrays: treat as different
        return False


def leaf_key(leaf: Any) -> tuple:
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype)
    return ("value", leaf)


class VectorizedRuntime:
    """All pending Fit requests of a step as batched torch.func computations (see module doc)."""
    name = "vectorized"

    def __init__(self, build: Callable[[], nn.Module], settings: TrainSettings, data: FederatedData,
                 threads: int | None = None, device: str | torch.device = "cpu",
                 builds: Mapping[Hashable, Callable[[], nn.Module]] | None = None,
                 model_keys: Sequence[Hashable] | None = None, step: str = "auto",
                 max_clients: int | None = None) -> None:
        self.threads = threads
        self.settings, self.data = settings, data
        self.device = torch.device(device)
        print(f"vectorized runtime: training on {describe_device(self.device)}", flush=True)
        self.model = build().to(self.device).train()  # a template: its own weights are never used
        self.names = [name for name, _ in self.model.named_parameters()]
        self.dtypes = {name: p.dtype for name, p in self.model.named_parameters()}
        self.blocker = model_blocker(self.model)
        self.dropout = dropout_layers(self.model)
        # The sequential trainer (on the same device) for the fallbacks, one per architecture. With
        # heterogeneous models only the clients whose builder is `build` are batched; the others
        # train sequentially. Evaluation: see evaluate_many.
        self.sequential = SequentialRuntime(build, settings, data, threads=threads, builds=builds,
                                            model_keys=model_keys, device=self.device)
        self.trainers = self.sequential.trainers
        self.trainer, self.evaluator = self.sequential.trainer, self.sequential.evaluator
        self.batchable = None if model_keys is None else [(builds or {})[key] is build for key in model_keys]
        self.reported: set[str] = set()
        self.jobs_vectorized = 0  # counters for tests and diagnostics
        self.jobs_sequential = 0
        self._pool: tuple[torch.Tensor, torch.Tensor] | None = None  # see _training_pool
        self.pool_offsets: list[int] = []
        self.step_kind = step_kind(step, self.device, settings.precision, self.dropout)
        self.max_clients = max_clients or default_max_clients(self.model, self.device)
        self.workspaces: list[tuple[tuple, tuple[ChunkTensors, StepShapes]]] = []  # see _workspace
        self.pin_host = self.device.type == "cuda"  # see _host_rows
        # Clients the round loop hands to one evaluate_many: a chunk on a GPU (one batched
        # evaluation); on a CPU the round loop's default (nothing gained, memory held).
        self.eval_block = self.max_clients if self.device.type == "cuda" else None
        if self.step_kind != "eager":
            self._note("step", f"each lock-step {'replays a CUDA graph' if self.step_kind == 'graphs' else 'runs'} "
                               f"per (members, batch size) shape, members padded with sink rows; at most "
                               f"{self.max_clients} clients train together")
        self.batched_eval = BatchedEvaluator(build, data, self.device, self.sequential.evaluate_many,
                                             batchable=self.batchable, note=self._note)

    # ------------------------------------------------------------------ training
    def fit_many(self, jobs: list[FitJob]) -> dict[int, FitOutcome]:
        return dict(self.fit_stream(list(jobs)))

    def fit_stream(self, jobs: list[FitJob]):
        """Chunk by chunk (at most `max_clients` consecutive clients, in client order): each
        chunk's results are handed out before the next chunk trains, so memory stays flat in the
        number of clients. The jobs are let go as they are taken."""
        pending = list(jobs)
        jobs.clear()
        for start in range(0, len(pending), self.max_clients):
            with thread_count(self.threads):
                outcomes = self._fit_all(pending[start:start + self.max_clients])
            for cid in list(outcomes):  # held by the caller only: freed before the next chunk trains
                yield cid, outcomes.pop(cid)

    def _fit_all(self, jobs: list[FitJob]) -> dict[int, FitOutcome]:
        outcomes: dict[int, FitOutcome] = {}
        if self.batchable is not None:
            other = [job for job in jobs if not self.batchable[job.cid]]
            if other:
                self._fallback(other, "architecture", "these clients use another model architecture "
                               "(client_model_options)", outcomes)
                jobs_left = [job for job in jobs if self.batchable[job.cid]]
                if jobs_left:
                    outcomes.update(self._fit_all_same(jobs_left))
                return {job.cid: outcomes[job.cid] for job in jobs}
        return self._fit_all_same(jobs)

    def _fit_all_same(self, jobs: list[FitJob]) -> dict[int, FitOutcome]:
        """Jobs of clients that all use the template's architecture."""
        outcomes: dict[int, FitOutcome] = {}
        for job in jobs:
            missing = set(self.names) - set(job.request.params)
            if missing:
                raise KeyError(f"Fit params lack {sorted(missing)[:3]}...: pass a full parameter dict")
        if self.blocker:
            self._fallback(jobs, "model", self.blocker, outcomes)
            return outcomes
        custom = [job for job in jobs if _needs_trainer(job.request)]
        if custom:
            self._fallback(custom, "custom-step", "they use a custom local step (Fit.step), extra trained "
                           "tensors (Fit.extra) or a training subset (Fit.samples), which the batched "
                           "trainer does not run", outcomes)
        plain = [job for job in jobs if not _needs_trainer(job.request)]
        for key, group in self._groups(plain):
            try:
                outcomes.update(self._fit_group(key, group))
            except Exception as err:  # the loss (or model) does not run under vmap
                name = _loss_name(group[0].request.loss)
                reason = f"the loss {name} cannot run under torch.vmap ({type(err).__name__}: {_first_sentence(err)})"
                self._fallback(group, f"loss:{name}", reason, outcomes)
            else:
                self.jobs_vectorized += len(group)
        return {job.cid: outcomes[job.cid] for job in jobs}

    def _groups(self, jobs: list[FitJob]) -> list[tuple[tuple, list[FitJob]]]:
        """(key, jobs) of the jobs one batched function can train, in first-seen order."""
        groups: list[tuple[tuple, list[FitJob]]] = []
        for job in jobs:
            request = job.request
            leaves, spec = tree_flatten(request.context)
            key = (loss_key(request.loss), request.trainable, request_lr(request, self.settings), spec,
                   tuple(leaf_key(leaf) for leaf in leaves))
            for group_key, members in groups:
                if same(group_key, key):
                    members.append(job)
                    break
            else:
                groups.append((key, [job]))
        return groups

    def _note(self, category: str, text: str) -> None:
        """Print `text` the first time `category` comes up in this run."""
        if category not in self.reported:
            self.reported.add(category)
            print(f"vectorized runtime: {text} (shown once per run)", flush=True)

    def _fallback(self, jobs: list[FitJob], category: str, reason: str, outcomes: dict[int, FitOutcome]) -> None:
        self._note(category, f"falling back to the sequential trainer ({self.device.type}) for these Fit "
                             f"requests because {reason}")
        for job in jobs:
            outcomes[job.cid] = self.trainers(job.cid).fit(job, *self._client_data(job.cid))
        self.jobs_sequential += len(jobs)

    def _client_data(self, cid: int) -> tuple[torch.Tensor, torch.Tensor]:
        client = self.data.clients[cid]
        return self.sequential.device_data.get(cid, "train", client.x_train, client.y_train)

    def _fit_group(self, key: tuple, jobs: list[FitJob]) -> dict[int, FitOutcome]:
        """One group of at most `max_clients` jobs in lock-step (engine/runtimes/lockstep.py)."""
        jobs, schedules = self._ordered_schedules(jobs)
        request = jobs[0].request
        pool = self._training_pool()
        offsets = [self.pool_offsets[job.cid] for job in jobs]
        if self.dropout:
            self._note("dropout", f"the model uses dropout ({', '.join(self.dropout[:3])}): vmap draws each "
                                  "client's masks from its own generator, the sequential trainer from a per-job "
                                  "seed; not the same masks, so results agree in distribution, not bit for bit")
        if self.step_kind == "eager":
            chunk, context_layout = self._stack_group(jobs, len(jobs), self._chunk_parts(jobs))
            step, update = self._step_functions(request, context_layout)
            for members, pool_rows, rows in step_plan(schedules, offsets, self.device, None, len(jobs)):
                train_members(step, update, chunk, pool, members, pool_rows, rows)
            return self._outcomes(jobs, chunk, schedules)
        capacity = chunk_capacity(len(jobs), self.max_clients)
        chunk, shapes = self._workspace(key, jobs, capacity, request, pool)
        for members, pool_rows, rows in step_plan(schedules, offsets, self.device,
                                                  lambda k: member_bucket(k, capacity), capacity):
            shapes(members, pool_rows, rows)
        return self._outcomes(jobs, chunk, schedules)

    def _step_functions(self, request, context_layout) -> tuple[Callable, Callable]:
        """The batched gradient of the group's loss and its stacked SGD update."""
        step = vmap(grad_and_value(self._loss_fn(request.loss, *context_layout)),
                    in_dims=(0, 0, None, 0, 0, 0, 0, None), randomness="different" if self.dropout else "error")
        update = functools.partial(stacked_sgd_step, self.settings, lr=request_lr(request, self.settings))
        return step, update

    def _workspace(self, key: tuple, jobs: list[FitJob], capacity: int, request, pool
                   ) -> tuple[ChunkTensors, StepShapes]:
        """The chunk tensors and step shapes kept for this group's kind (same loss, layout and
        capacity), with the jobs' values written into the kept tensors: graphs captured in an
        earlier round replay on them, and nothing is allocated. A new kind is stacked and kept; the
        least recently used of more than `WORKSPACES` kinds is dropped."""
        parts = self._chunk_parts(jobs)
        full_key = (key, self._chunk_layout(parts, capacity))
        for index, (known, (chunk, shapes)) in enumerate(self.workspaces):
            if same(known, full_key):
                self.workspaces.append(self.workspaces.pop(index))
                self._stack_group(jobs, capacity, parts, into=chunk)
                return chunk, shapes
        chunk, context_layout = self._stack_group(jobs, capacity, parts)
        step, update = self._step_functions(request, context_layout)
        graphs = self.step_kind == "graphs" and not self.dropout
        run_step = functools.partial(train_members, step, update, chunk, pool)
        shapes = StepShapes(run_step, capacity, self.device, graphs,
                            note=functools.partial(self._note, "graph-capture"))
        self.workspaces.append((full_key, (chunk, shapes)))
        del self.workspaces[:-WORKSPACES]
        return chunk, shapes

    def _training_pool(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every client's training rows, concatenated on the device once per run (client c's rows
        start at `self.pool_offsets[c]`): a step's batches of all clients are then one gather
        instead of one indexing per client (the cost that dominated a step on a GPU)."""
        if self._pool is None:
            clients = self.data.clients
            x, y, self.pool_offsets = pooled_rows([c.x_train for c in clients], [c.y_train for c in clients],
                                                  self.device)
            self._pool = (x, y)
        return self._pool

    def _ordered_schedules(self, jobs: list[FitJob]) -> tuple[list[FitJob], list[list[torch.Tensor]]]:
        """Each job's mini-batches (seeded as in LocalTrainer), jobs sorted by decreasing number of
        batches, then last batch size: the clients still training at a step, and those sharing a
        batch size, then mostly form contiguous ranges of the stack (views, no copies)."""
        s = self.settings
        schedules = {job.cid: batch_schedule(job.request, s, self.data.clients[job.cid].n_train,
                                             torch_generator(s.seed, job.rnd, job.cid, job.seed_tag("batches")))
                     for job in jobs}
        jobs = sorted(jobs, key=lambda job: (-len(schedules[job.cid]),
                                             -len(schedules[job.cid][-1]) if schedules[job.cid] else 0))
        return jobs, [schedules[job.cid] for job in jobs]

    def _chunk_parts(self, jobs: list[FitJob]) -> tuple[list[str], list[dict], list[dict], tuple]:
        """Trainable names, each client's frozen parameters and tensor context leaves, and the
        context's pytree layout with its non-tensor constants."""
        part = jobs[0].request.trainable
        trainable = [n for n in self.names if part == "all" or n.startswith(part + ".")]
        frozen_names = [n for n in self.names if n not in trainable]
        frozen = [{n: job.request.params[n] for n in frozen_names} for job in jobs]
        flat = [tree_flatten(job.request.context) for job in jobs]
        leaves, spec = flat[0]
        constants = {i: leaf for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor)}
        context = [{i: leaf for i, leaf in enumerate(client_leaves) if i not in constants} for client_leaves, _ in flat]
        return trainable, frozen, context, (spec, constants, len(leaves))

    def _chunk_layout(self, parts: tuple, capacity: int) -> tuple:
        """`ChunkTensors.layout()` of the chunk of these parts (`_chunk_parts`), without stacking."""
        trainable, frozen, context, _ = parts
        return chunk_layout(capacity, trainable, trainable if self.settings.momentum else (),
                            stacked_layout(frozen), stacked_layout(context))

    def _stack_group(self, jobs: list[FitJob], capacity: int, parts: tuple, into: ChunkTensors | None = None
                     ) -> tuple[ChunkTensors, tuple]:
        """The jobs' `_chunk_parts`: trainable parameters and momentum stacked [capacity + 1, ...],
        frozen parameters and context tensors stacked or shared; and the context's pytree layout with
        its non-tensor constants. `into`: a kept chunk of the same layout, written in place (and
        returned)."""
        trainable, frozen, context, context_layout = parts
        params = {n: stack_rows([job.request.params[n] for job in jobs], capacity, self.device, self.dtypes[n],
                                None if into is None else into.params[n])
                  for n in trainable}
        momentum = (self._stack_momentum(jobs, params, capacity, None if into is None else into.momentum)
                    if self.settings.momentum else {})
        frozen_stack = Stacked(frozen, capacity, self.device, self.dtypes, None if into is None else into.frozen)
        context_stack = Stacked(context, capacity, self.device, into=None if into is None else into.context)
        if into is not None:
            into.restart(len(jobs))
            return into, context_layout
        return ChunkTensors(params, momentum, frozen_stack, context_stack, capacity, len(jobs)), context_layout

    def _stack_momentum(self, jobs: list[FitJob], params: dict[str, torch.Tensor], capacity: int,
                        into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Momentum buffers [capacity + 1, ...]: each client's saved buffer (keep_optimizer_state),
        else zeros (a zero buffer gives SGD's first step `buf = grad` exactly)."""
        out = {}
        for n, stacked in params.items():
            saved = [(job.optimizer_state or {}).get(n) for job in jobs]
            out[n] = torch.zeros_like(stacked) if into is None else into[n]
            if any(b is not None for b in saved):
                stack_rows([torch.zeros_like(stacked[0]) if b is None else b for b in saved], capacity,
                           self.device, stacked.dtype, out[n])
            elif into is not None:
                out[n][:len(jobs)].zero_()
        return out

    def _loss_fn(self, loss: Callable, spec, constants: dict[int, Any], num_leaves: int):
        """One client's loss as a function of (trainable, frozen batched, frozen shared, x, y,
        batch row indices, context batched, context shared), for vmap(grad_and_value(...))."""
        body, head, names = self.model.body, self.model.head, self.names
        precision = functools.partial(precision_context, self.settings.precision, self.device)

        def client_loss(trainable, frozen_batched, frozen_shared, xb, yb, index, context_batched, context_shared):
            merged = {**frozen_shared, **frozen_batched, **trainable}
            live = {n: merged[n] for n in names}  # module order, like LocalTrainer's parameter dict
            with precision():
                features = functional_call(body, unprefixed(live, "body"), (xb,))
                logits = functional_call(head, unprefixed(live, "head"), (features,))
            out = Forward(features.float(), logits.float(), index)
            leaves = [constants[i] if i in constants else
                      context_batched[i] if i in context_batched else context_shared[i] for i in range(num_leaves)]
            return loss(out, yb, live, tree_unflatten(leaves, spec))
        return client_loss

    def _outcomes(self, jobs: list[FitJob], chunk: ChunkTensors, schedules) -> dict[int, FitOutcome]:
        k = len(jobs)
        trained = {n: self._host_rows(tensor[:k]) for n, tensor in chunk.params.items()}
        keep = self.settings.keep_optimizer_state and self.settings.momentum
        momentum = {n: self._host_rows(tensor[:k]) for n, tensor in chunk.momentum.items()} if keep else {}
        totals = chunk.totals[:k].cpu()
        out = {}
        for row, job in enumerate(jobs):
            # A trained tensor is its row of the chunk's host copy (contiguous; files written of
            # it hold its own values only: run_files.compact_tensor), a frozen one a copy.
            result = {n: trained[n][row] if n in trained else self._host_copy(job.request.params[n], n)
                      for n in self.names}
            steps = len(schedules[row])
            samples = sum(len(batch) for batch in schedules[row])
            kept = None
            if keep:  # like LocalTrainer: trained tensors' buffers, the saved ones of frozen tensors
                kept = dict(job.optimizer_state or {})
                if steps:
                    kept.update({n: m[row] for n, m in momentum.items()})
            out[job.cid] = FitOutcome(result, None, float(totals[row]) / max(steps, 1), steps, samples, kept)
        return out

    def _host_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """A chunk's trained rows on the host, one tensor per name and chunk, whose rows become the
        replies. A CPU chunk of the eager step is new each time and is used as it is; a kept chunk
        (written again by the next chunk) and a GPU chunk are copied. On a GPU the copy goes to
        page-locked memory from PyTorch's caching host allocator: a faster transfer, and once the
        round loop has let go of a chunk's replies the next chunk's copy reuses that memory instead
        of faulting in gigabytes of fresh pages (the cost that grew with the clients, issue 49)."""
        if self.device.type == "cpu":
            return rows if self.step_kind == "eager" else rows.clone()
        copy, refused = host_copy(rows, self.pin_host)
        if refused:
            self.pin_host = False
            self._note("pinned", f"copying trained models to ordinary host memory: page-locked memory was "
                                 f"refused ({refused})")
        return copy

    def _host_copy(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return tensor.detach().to("cpu", self.dtypes[name]).clone(memory_format=torch.contiguous_format)

    # ------------------------------------------------------------------ evaluation
    def evaluate_many(self, items: list[EvalItem]) -> dict[int, ClientEval]:
        """Many clients per forward (BatchedEvaluator); the sequential evaluator for the rest."""
        with thread_count(self.threads), torch.inference_mode():
            return self.batched_eval.evaluate(items)

    def describe_devices(self) -> str:
        return describe_device(self.device)

    def close(self) -> None:
        self.sequential.close()
        self.batched_eval.close()
        self._pool = None
        self.workspaces.clear()


def host_copy(tensor: torch.Tensor, pinned: bool) -> tuple[torch.Tensor, str | None]:
    """`tensor` copied to host memory, page-locked when `pinned` and granted; and why it was not
    (page-locking refused: no accelerator, a host short of memory, limits), else None."""
    if pinned:
        try:
            return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor), None
        except RuntimeError as err:
            return tensor.to("cpu", copy=True), _first_sentence(err)
    return tensor.to("cpu", copy=True), None


def _needs_trainer(request) -> bool:
    """Requests only the sequential trainer runs: custom steps, extra tensors, training subsets."""
    return request.step is not None or bool(request.extra) or request.samples is not None


def _loss_name(loss: Callable) -> str:
    func = loss.func if isinstance(loss, functools.partial) else loss
    return getattr(func, "__qualname__", type(func).__name__)


def _first_sentence(err: Exception, limit: int = 300) -> str:
    text = " ".join(str(err).split())
    end = text.find(". ")
    text = text if end < 0 else text[:end + 1]
    return text if len(text) <= limit else text[:limit - 3] + "..."
