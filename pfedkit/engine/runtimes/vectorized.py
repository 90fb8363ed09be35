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
from pfedkit.engine.device import describe_device
from pfedkit.engine.protocols import EvalItem
from pfedkit.engine.runtimes.batched_eval import BatchedEvaluator
from pfedkit.engine.runtimes.sequential import SequentialRuntime
from pfedkit.engine.trainer import (FitJob, FitOutcome, TrainSettings, batch_schedule, precision_context,
                                    request_lr)
from pfedkit.evaluation import ClientEval


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


class _Stacked:
    """Tensors of a group indexed by name or leaf position: stacked [K, ...] where clients differ,
    shared (passed once, vmap in_dims None) where every client holds the very same tensor."""

    def __init__(self, per_client: list[dict[Any, torch.Tensor]], device: torch.device,
                 dtypes: dict[Any, torch.dtype] | None = None) -> None:
        self.batched: dict[Any, torch.Tensor] = {}
        self.shared: dict[Any, torch.Tensor] = {}
        for key in per_client[0]:
            tensors = [values[key] for values in per_client]
            dtype = dtypes[key] if dtypes else tensors[0].dtype
            if all(t is tensors[0] for t in tensors):
                self.shared[key] = tensors[0].detach().to(device, dtype)
            else:
                self.batched[key] = torch.stack([t.detach().to(device, dtype) for t in tensors])


class VectorizedRuntime:
    """All pending Fit requests of a step as batched torch.func computations (see module doc)."""
    name = "vectorized"

    def __init__(self, build: Callable[[], nn.Module], settings: TrainSettings, data: FederatedData,
                 threads: int | None = None, device: str | torch.device = "cpu",
                 builds: Mapping[Hashable, Callable[[], nn.Module]] | None = None,
                 model_keys: Sequence[Hashable] | None = None) -> None:
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
        self.batched_eval = BatchedEvaluator(build, data, self.device, self.sequential.evaluate_many,
                                             batchable=self.batchable, note=self._note)

    # ------------------------------------------------------------------ training
    def fit_many(self, jobs: list[FitJob]) -> dict[int, FitOutcome]:
        with thread_count(self.threads):
            return self._fit_all(jobs)

    def fit_stream(self, jobs: list[FitJob]):
        """One batched computation: every result is ready at once (then the jobs are let go)."""
        outcomes = self.fit_many(jobs)
        jobs.clear()
        yield from outcomes.items()

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
        for group in self._groups(plain):
            try:
                outcomes.update(self._fit_group(group))
            except Exception as err:  # the loss (or model) does not run under vmap
                name = _loss_name(group[0].request.loss)
                reason = f"the loss {name} cannot run under torch.vmap ({type(err).__name__}: {_first_sentence(err)})"
                self._fallback(group, f"loss:{name}", reason, outcomes)
            else:
                self.jobs_vectorized += len(group)
        return {job.cid: outcomes[job.cid] for job in jobs}

    def _groups(self, jobs: list[FitJob]) -> list[list[FitJob]]:
        """Jobs that one batched function can train, in first-seen order."""
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
        return [members for _, members in groups]

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

    def _fit_group(self, jobs: list[FitJob]) -> dict[int, FitOutcome]:
        jobs, schedules = self._ordered_schedules(jobs)
        state = self._stack_group(jobs)
        request = jobs[0].request
        step = vmap(grad_and_value(self._loss_fn(request.loss, *state["context_layout"])),
                    in_dims=(0, 0, None, 0, 0, 0, 0, None), randomness="different" if self.dropout else "error")
        if self.dropout:
            self._note("dropout", f"the model uses dropout ({', '.join(self.dropout[:3])}): vmap draws each "
                                  "client's masks from its own generator, the sequential trainer from a per-job seed; not "
                                  "the same masks, so results agree in distribution, not bit for bit")
        x_all, y_all = self._training_pool()
        totals = torch.zeros(len(jobs), dtype=torch.float64, device=self.device)
        for groups in self._step_plan(jobs, schedules):
            for members, rows, pool_rows in groups:
                batch = (x_all[pool_rows], y_all[pool_rows], rows)  # one gather per step and batch size
                self._train_members(step, state, members, batch, request_lr(request, self.settings), totals)
        return self._outcomes(jobs, state, schedules, totals.cpu())

    def _training_pool(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every client's training rows, concatenated on the device once per run (client c's rows
        start at `self.pool_offsets[c]`): a step's batches of all clients are then one gather
        instead of one indexing per client (the cost that dominated a step on a GPU)."""
        if self._pool is None:
            clients = self.data.clients
            self.pool_offsets = [0]
            for client in clients:
                self.pool_offsets.append(self.pool_offsets[-1] + client.n_train)
            x = torch.cat([client.x_train for client in clients]) if clients else torch.empty(0)
            y = torch.cat([client.y_train for client in clients]) if clients else torch.empty(0)
            self._pool = (x.to(self.device), y.to(self.device))
        return self._pool

    def _step_plan(self, jobs: list[FitJob], schedules: list[list[torch.Tensor]]):
        """Per mini-batch step t, the groups of clients training at t with the same batch size:
        (member positions, [k, B] rows in each client's training set, [k, B] rows of the pool),
        built on the host and moved to the device in one transfer."""
        layout, rows = [], []
        for t in range(max((len(schedule) for schedule in schedules), default=0)):
            by_size: dict[int, list[int]] = {}
            for k, schedule in enumerate(schedules):
                if t < len(schedule):  # clients whose batches have run out are skipped
                    by_size.setdefault(len(schedule[t]), []).append(k)
            for size, members in by_size.items():
                layout.append((t, members, size))
                rows.append(torch.stack([schedules[k][t] for k in members]).reshape(-1))
        if not rows:
            return []
        offsets = torch.tensor([self.pool_offsets[job.cid] for job in jobs])
        local = torch.cat(rows)
        owner = torch.cat([torch.tensor(members).repeat_interleave(size) for _, members, size in layout])
        both = torch.stack([local, local + offsets[owner]]).to(self.device)
        plan: list[list] = [[] for _ in range(layout[-1][0] + 1)]
        start = 0
        for t, members, size in layout:
            stop = start + len(members) * size
            plan[t].append((members, both[0, start:stop].view(len(members), size),
                            both[1, start:stop].view(len(members), size)))
            start = stop
        return plan

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

    def _stack_group(self, jobs: list[FitJob]) -> dict[str, Any]:
        """Trainable parameters and momentum stacked [K, ...]; frozen parameters and context
        tensors stacked or shared; the context's pytree layout with its non-tensor constants."""
        part = jobs[0].request.trainable
        trainable = [n for n in self.names if part == "all" or n.startswith(part + ".")]
        frozen = [n for n in self.names if n not in trainable]
        params = {n: self._stacked_copy([job.request.params[n] for job in jobs], self.dtypes[n]) for n in trainable}
        flat = [tree_flatten(job.request.context) for job in jobs]
        leaves, spec = flat[0]
        constants = {i: leaf for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor)}
        return {
            "params": params,
            "momentum": self._stack_momentum(jobs, params) if self.settings.momentum else {},
            "frozen": _Stacked([{n: job.request.params[n] for n in frozen} for job in jobs], self.device, self.dtypes),
            "context": _Stacked([{i: leaf for i, leaf in enumerate(client_leaves) if i not in constants}
                                 for client_leaves, _ in flat], self.device),
            "context_layout": (spec, constants, len(leaves)),
        }

    def _stacked_copy(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """[K, ...] copy of the clients' tensors on the device. The very same tensor for every
        client (the global model FedAvg sends) crosses to the device once and is repeated there:
        at 1,000 clients that is one FedAvgCNN transfer instead of 2.3 GB."""
        first = tensors[0]
        if all(t is first for t in tensors):
            one = first.detach().to(self.device, dtype)
            return one.unsqueeze(0).expand(len(tensors), *one.shape).clone()
        return torch.stack([t.detach().to(self.device, dtype) for t in tensors])

    def _stack_momentum(self, jobs: list[FitJob], params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Momentum buffers [K, ...]: each client's saved buffer (keep_optimizer_state), else zeros
        (a zero buffer gives SGD's first step `buf = grad` exactly)."""
        out = {}
        for n, stacked in params.items():
            saved = [(job.optimizer_state or {}).get(n) for job in jobs]
            out[n] = (torch.zeros_like(stacked) if all(b is None for b in saved) else
                      torch.stack([torch.zeros_like(stacked[k]) if b is None else b.to(self.device, stacked.dtype)
                                   for k, b in enumerate(saved)]))
        return out

    def _train_members(self, step, state: dict, members: list[int], batch: tuple[torch.Tensor, ...],
                       lr: float, totals: torch.Tensor) -> None:
        """One SGD step of the clients `members` (positions in the group) on their batches
        (x, y, row indices), each stacked [k, B, ...]."""
        xb, yb, rows = batch
        frozen, context = state["frozen"], state["context"]
        low, high = members[0], members[-1] + 1
        contiguous = high - low == len(members)
        if contiguous:  # views: the update lands in the stacked tensors directly
            take = lambda tensors: {n: v[low:high] for n, v in tensors.items()}  # noqa: E731
        else:
            index = torch.tensor(members, device=self.device)
            take = lambda tensors: {n: v.index_select(0, index) for n, v in tensors.items()}  # noqa: E731
        params, momentum = take(state["params"]), take(state["momentum"])
        grads, loss = step(params, take(frozen.batched), frozen.shared, xb, yb, rows, take(context.batched),
                           context.shared)
        self._sgd_step(params, grads, momentum, lr)
        if contiguous:
            totals[low:high] += loss.double()
            return
        for part, updated in (("params", params), ("momentum", momentum)):
            for n, tensor in updated.items():
                state[part][n].index_copy_(0, index, tensor)
        totals.index_add_(0, index, loss.double())

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

    @torch.no_grad()
    def _sgd_step(self, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor],
                  momentum: dict[str, torch.Tensor], lr: float) -> None:
        """torch.optim.SGD(foreach) after clip_grad_norm_, on [k, ...] tensors, k clients at once."""
        s = self.settings
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

    def _outcomes(self, jobs, state, schedules, totals) -> dict[int, FitOutcome]:
        trained = {n: tensor.cpu() for n, tensor in state["params"].items()}
        keep = self.settings.keep_optimizer_state and self.settings.momentum
        momentum = {n: tensor.cpu() for n, tensor in state["momentum"].items()} if keep else {}
        out = {}
        for k, job in enumerate(jobs):
            result = {}
            for n in self.names:
                source = trained[n][k] if n in trained else job.request.params[n].detach().to("cpu", self.dtypes[n])
                result[n] = source.clone(memory_format=torch.contiguous_format)
            steps = len(schedules[k])
            samples = sum(len(batch) for batch in schedules[k])
            kept = None
            if keep:  # like LocalTrainer: trained tensors' buffers, the saved ones of frozen tensors
                kept = dict(job.optimizer_state or {})
                if steps:
                    kept.update({n: m[k].clone(memory_format=torch.contiguous_format) for n, m in momentum.items()})
            out[job.cid] = FitOutcome(result, None, float(totals[k]) / max(steps, 1), steps, samples, kept)
        return out

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
