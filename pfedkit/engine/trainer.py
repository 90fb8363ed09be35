"""Local training, the reference implementation: one client's `Fit` request at a time.

A `LocalTrainer` owns one model instance and reuses it for every request: parameters are copied
in, trained with SGD on mini-batches drawn from a generator seeded by
(seed, round, client, "fit", request index), and copied out. Data are in-memory tensors, so a
mini-batch is one index gather; no DataLoader.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pfedkit.algorithms.base import Fit, Forward
from pfedkit.algorithms.params import Params
from pfedkit.engine.seeds import derive_seed, torch_generator


@dataclass(frozen=True)
class TrainSettings:
    """The optimiser settings of a run (from the config)."""
    local_epochs: int
    batch_size: int
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float | None = None
    drop_last: bool = False
    precision: str = "fp32"
    seed: int = 0
    keep_optimizer_state: bool = False


@dataclass(frozen=True)
class FitJob:
    """One client's pending request, as a runtime receives it."""
    rnd: int
    cid: int
    index: int  # how many Fit requests this client already made this round
    request: Fit
    buffers: Params | None
    # The client's saved state of the optimizer `request.optimizer` (SGD momentum buffers by
    # parameter name); None: a fresh optimizer. Only with `keep_optimizer_state`.
    optimizer_state: Params | None = None


@dataclass
class FitOutcome:
    params: Params
    buffers: Params | None
    mean_loss: float
    steps: int
    samples: int  # training samples processed (for throughput figures)
    optimizer_state: Params | None = None  # with keep_optimizer_state: the state to keep


def request_lr(request: Fit, settings: TrainSettings) -> float:
    """The request's learning rate; None means the config's (0 is a real value: no update)."""
    return settings.lr if request.lr is None else request.lr


def batch_order(n: int, batch_size: int, drop_last: bool, generator: torch.Generator) -> list[torch.Tensor]:
    """One epoch's mini-batch index tensors, from a seeded permutation."""
    order = torch.randperm(n, generator=generator)
    stop = n - n % batch_size if drop_last else n
    return [order[i:i + batch_size] for i in range(0, stop, batch_size)]


def batch_schedule(request: Fit, settings: TrainSettings, n: int, generator: torch.Generator) -> list[torch.Tensor]:
    """All mini-batch index tensors of one request, in order: `request.epochs` epochs (default
    the config's local_epochs), or exactly `request.steps` batches drawn epoch by epoch."""
    epochs = settings.local_epochs if request.epochs is None else request.epochs
    batches: list[torch.Tensor] = []
    epoch = 0
    while request.steps is not None or epoch < epochs:
        order = batch_order(n, settings.batch_size, settings.drop_last, generator)
        if not order:
            break  # fewer samples than one batch with drop_last: nothing to train on
        for batch in order:
            if request.steps is not None and len(batches) == request.steps:
                return batches
            batches.append(batch)
        epoch += 1
    return batches


class LocalTrainer:
    def __init__(self, build: Callable[[], nn.Module], settings: TrainSettings) -> None:
        self.model = build()
        self.settings = settings
        self.parameters = dict(self.model.named_parameters())
        self.buffers = dict(self.model.named_buffers())

    def fit(self, job: FitJob, x: torch.Tensor, y: torch.Tensor) -> FitOutcome:
        request, s = job.request, self.settings
        self._load(request.params, job.buffers)
        trainable = self._set_trainable(request.trainable)
        optimizer = torch.optim.SGD(trainable, lr=request_lr(request, s), momentum=s.momentum,
                                    weight_decay=s.weight_decay, foreach=True)
        self._load_momentum(optimizer, job.optimizer_state)
        generator = torch_generator(s.seed, job.rnd, job.cid, f"fit-{job.index}")
        self.model.train()
        total, steps, samples = 0.0, 0, 0
        # Dropout draws from torch's global generator: seed it per job (and restore it after), so
        # results do not depend on which clients a process trained before this one.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(s.seed, job.rnd, job.cid, f"dropout-{job.index}"))
            for batch in batch_schedule(request, s, len(y), generator):
                total += self._step(request, optimizer, trainable, x[batch], y[batch], batch)
                steps += 1
                samples += len(batch)
        return FitOutcome(self._params_out(), self._buffers_out(), total / max(steps, 1), steps, samples,
                          self._momentum_out(optimizer, job.optimizer_state))

    def _step(self, request: Fit, optimizer, trainable, xb, yb, index) -> float:
        optimizer.zero_grad(set_to_none=True)
        with self._precision():
            features = self.model.body(xb)
            logits = self.model.head(features)
        out = Forward(features.float(), logits.float(), index)
        loss = request.loss(out, yb, self.parameters, request.context)
        loss.backward()
        if self.settings.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(trainable, self.settings.grad_clip, foreach=True)
        optimizer.step()
        return float(loss.detach())

    def _precision(self):
        if self.settings.precision == "bf16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @torch.no_grad()
    def _load(self, params: Params, buffers: Params | None) -> None:
        missing = set(self.parameters) - set(params)
        if missing:
            raise KeyError(f"Fit params lack {sorted(missing)[:3]}...: pass a full parameter dict")
        for name, tensor in self.parameters.items():
            tensor.copy_(params[name])
        for name, tensor in (buffers or {}).items():
            self.buffers[name].copy_(tensor)

    @torch.no_grad()
    def _load_momentum(self, optimizer: torch.optim.SGD, saved: Params | None) -> None:
        """Resume the client's optimizer: its saved momentum buffers for the trainable tensors."""
        if not saved or not self.settings.momentum:
            return
        for name, tensor in self.parameters.items():
            if tensor.requires_grad and name in saved:
                optimizer.state[tensor]["momentum_buffer"] = saved[name].clone()

    def _momentum_out(self, optimizer: torch.optim.SGD, saved: Params | None) -> Params | None:
        """The optimizer state to keep: buffers of the tensors trained now, the saved ones of the
        tensors this request froze (one optimizer over the whole model, as in PFLlib)."""
        if not (self.settings.keep_optimizer_state and self.settings.momentum):
            return None
        state = dict(saved or {})
        for name, tensor in self.parameters.items():
            buffer = optimizer.state.get(tensor, {}).get("momentum_buffer")
            if buffer is not None:
                state[name] = buffer.detach().clone(memory_format=torch.contiguous_format)
        return state

    def _set_trainable(self, part: str) -> list[torch.Tensor]:
        chosen = []
        for name, tensor in self.parameters.items():
            train = part == "all" or name.startswith(part + ".")
            tensor.requires_grad_(train)
            if train:
                chosen.append(tensor)
        return chosen

    def _params_out(self) -> Params:
        return {name: t.detach().clone(memory_format=torch.contiguous_format) for name, t in self.parameters.items()}

    def _buffers_out(self) -> Params | None:
        if not self.buffers:
            return None
        return {name: t.detach().clone() for name, t in self.buffers.items()}
