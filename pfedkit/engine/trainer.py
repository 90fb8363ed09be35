"""Local training, the reference implementation: one client's `Fit` request at a time.

A `LocalTrainer` owns one model instance and reuses it for every request: parameters are copied
in, trained with SGD on mini-batches drawn from a generator seeded by
(seed, round, client, "fit", request index), and copied out. Data are in-memory tensors, so a
mini-batch is one index gather; no DataLoader.
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from pfedkit.core.batches import batch_order
from pfedkit.core.contract import Batch, Fit, Forward
from pfedkit.core.errors import ConfigError
from pfedkit.core.params import Params, unprefixed
from pfedkit.core.seeds import derive_seed, torch_generator
from pfedkit.core.sgd import clip_by_total_norm
from pfedkit.engine.device import seed_device_generator, to_device


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
    compile: bool = False
    # Sample-level DP-SGD (config dp.level=sample, pfedkit/privacy/dp_sgd.py): per-sample gradient
    # clip and noise multiplier for training Fits; None: ordinary SGD.
    dp_sample_clip: float | None = None
    dp_sample_noise: float = 0.0
    # config local_steps: a Fit that names neither epochs nor steps runs exactly this many batches
    local_steps: int | None = None


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
    # "fit" for training; "adapt" for evaluation-time adaptation (Algorithm.adapt), whose batches
    # and dropout masks are drawn from generators of their own.
    purpose: str = "fit"

    def seed_tag(self, kind: str) -> str:
        """The tag of this job's `kind` generator ("batches" or "dropout"), unique per request."""
        if self.purpose == "fit":  # the names used since the first release: same numbers as before
            return f"fit-{self.index}" if kind == "batches" else f"dropout-{self.index}"
        return f"{self.purpose}-{kind}-{self.index}"


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


def precision_context(precision: str, device: torch.device):
    """The forward pass's numeric context: bf16 autocast on `device`, or nothing for fp32 (the
    sequential trainer and the vectorized runtime compute under the same one)."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def batch_schedule(request: Fit, settings: TrainSettings, n: int, generator: torch.Generator) -> list[torch.Tensor]:
    """All mini-batch index tensors of one request, in order: `request.epochs` epochs, or exactly
    `request.steps` batches drawn epoch by epoch; a request naming neither gets the config's
    local_steps batches when it sets them, else its local_epochs epochs."""
    steps = request.steps if request.epochs is not None or request.steps is not None else settings.local_steps
    epochs = settings.local_epochs if request.epochs is None else request.epochs
    batches: list[torch.Tensor] = []
    drop_last = settings.drop_last if request.drop_last is None else request.drop_last
    epoch = 0
    while steps is not None or epoch < epochs:
        order = batch_order(n, settings.batch_size, drop_last, generator)
        if not order:
            break  # fewer samples than one batch with drop_last: nothing to train on
        for batch in order:
            if steps is not None and len(batches) == steps:
                return batches
            batches.append(batch)
        epoch += 1
    return batches


def request_schedule(request: Fit, settings: TrainSettings, n: int, generator: torch.Generator) -> list[torch.Tensor]:
    """The request's mini-batches as positions in the client's training set (of size n): over
    `request.samples` when it names a subset, else over all n samples."""
    if request.samples is None:
        return batch_schedule(request, settings, n, generator)
    if len(request.samples) and int(request.samples.max()) >= n:
        raise IndexError(f"Fit.samples names position {int(request.samples.max())} of a training set of {n} samples")
    return [request.samples[batch] for batch in batch_schedule(request, settings, len(request.samples), generator)]


class LocalTrainer:
    """Trains on `device`: the model lives there, `fit` takes x and y already there (the runtime
    keeps each client's data on the device) and host parameters, and returns host tensors."""

    def __init__(self, build: Callable[[], nn.Module], settings: TrainSettings,
                 device: torch.device = torch.device("cpu")) -> None:
        self.device = device
        self.model = build().to(device)
        self.settings = settings
        self.parameters = dict(self.model.named_parameters())
        self.buffers = dict(self.model.named_buffers())
        self.body_and_head = compiled(self._body_and_head) if settings.compile else self._body_and_head

    def _body_and_head(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.model.body(x)
        return features, self.model.head(features)

    def fit(self, job: FitJob, x: torch.Tensor, y: torch.Tensor) -> FitOutcome:
        request, s = self._on_device(job.request), self.settings
        self._load(request.params, job.buffers)
        live = self._live(request)
        trainable = self._set_trainable(request.trainable, live)
        generator = torch_generator(s.seed, job.rnd, job.cid, job.seed_tag("batches"))
        self.model.train()
        # Dropout draws from torch's global generator: seed it per job (and restore it after), so
        # results do not depend on which clients a process trained before this one.
        on_gpu = self.device.type == "cuda"
        with torch.random.fork_rng(devices=[self.device] if on_gpu else []):
            # This device's generator only: torch.manual_seed also seeds every accelerator backend,
            # which on a CPU build records a stack trace per backend (~1 ms a job).
            dropout_seed = derive_seed(s.seed, job.rnd, job.cid, job.seed_tag("dropout"))
            torch.default_generator.manual_seed(dropout_seed)
            seed_device_generator(self.device, dropout_seed)
            schedule = request_schedule(request, s, len(y), generator)
            if on_gpu:  # the indices beside the data they pick
                schedule = [batch.to(self.device) for batch in schedule]
            dp_sgd = s.dp_sample_clip is not None and job.purpose == "fit"  # adaptation stays on the client
            if request.step is not None:
                if dp_sgd:
                    raise ConfigError("dp.level=sample: this algorithm trains with a custom local step (Fit.step), "
                                      "which DP-SGD does not cover; use dp.level=client or none")
                return self._fit_custom(request, live, trainable, schedule, x, y, job.optimizer_state)
            optimizer = torch.optim.SGD([live[n] for n in trainable], lr=request_lr(request, s),
                                        momentum=s.momentum, weight_decay=s.weight_decay, foreach=True)
            self._load_momentum(optimizer, live, job.optimizer_state)
            # Summed in float64 on the device: the same numbers as adding Python floats, without
            # a host synchronisation per step on a GPU.
            total, samples = torch.zeros((), dtype=torch.float64, device=self.device), 0
            noise = self._dp_noise_generator(job) if dp_sgd else None
            for batch in schedule:
                if dp_sgd:
                    total += self._dp_step(request, optimizer, live, trainable, x[batch], y[batch], batch, noise)
                else:
                    total += self._step(request, optimizer, live, trainable, x[batch], y[batch], batch)
                samples += len(batch)
        return FitOutcome(self._params_out(live), self._buffers_out(), float(total) / max(len(schedule), 1),
                          len(schedule), samples, self._momentum_out(optimizer, live, job.optimizer_state))

    def _fit_custom(self, request: Fit, live: Params, trainable: list[str], schedule: list[torch.Tensor],
                    x, y, saved: Params | None = None) -> FitOutcome:
        """Run `request.step` over consecutive groups of `batches_per_step` batches. The config's
        momentum, weight decay, clipping and kept optimizer state reach only a step that updates
        through `tools.sgd_step` (`saved`: the client's kept momentum buffers of this request's
        optimizer); a step that updates the params itself returns no optimizer state."""
        for tensor in live.values():
            tensor.requires_grad_(False)  # the step differentiates copies (`loss_and_grad`)
        tools = _Tools(self, request, live, [name for name in trainable if name in self.parameters], saved)
        size = request.batches_per_step
        groups = [schedule[i:i + size] for i in range(0, len(schedule) - size + 1, size)]
        total, samples = 0.0, 0
        for group in groups:
            total += float(request.step(tools, [Batch(x[b], y[b], b) for b in group]))
            samples += sum(len(b) for b in group)
        return FitOutcome(self._params_out(live), self._buffers_out(), total / max(len(groups), 1),
                          len(groups), samples, tools.optimizer_state_out(saved))

    def forward(self, params: Params, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(features, logits) of the model at `params` (module buffers, train/eval mode as set)."""
        with self._precision():
            features = functional_call(self.model.body, unprefixed(params, "body"), (x,), strict=False)
            logits = functional_call(self.model.head, unprefixed(params, "head"), (features,), strict=False)
        return features, logits

    def _on_device(self, request: Fit) -> Fit:
        """The request with its context and extra tensors on the trainer's device."""
        if self.device.type == "cpu":
            return request
        return dataclasses.replace(request, context=to_device(request.context, self.device),
                                   extra=to_device(request.extra, self.device))

    def _live(self, request: Fit) -> Params:
        """The model's parameters (the module's own tensors) and leaf copies of `request.extra`."""
        extra = {name: t.detach().clone().requires_grad_(True) for name, t in request.extra.items()}
        return {**self.parameters, **extra}

    def _step(self, request: Fit, optimizer, live, trainable, xb, yb, index) -> torch.Tensor:
        try:
            loss = self._loss_and_backward(request, optimizer, live, xb, yb, index)
        except Exception as err:  # noqa: BLE001 - a compiler failure surfaces as any exception
            if self.body_and_head == self._body_and_head:
                raise
            warnings.warn(f"compile=true: torch.compile failed ({type(err).__name__}: {str(err)[:200]}); "
                          "training eagerly instead", RuntimeWarning, stacklevel=2)
            self.body_and_head = self._body_and_head  # nothing was updated yet: redo the step eagerly
            loss = self._loss_and_backward(request, optimizer, live, xb, yb, index)
        if self.settings.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_([live[n] for n in trainable], self.settings.grad_clip, foreach=True)
        optimizer.step()
        return loss.detach().double()

    def _dp_noise_generator(self, job: FitJob) -> torch.Generator:
        """DP-SGD's noise, seeded by (seed, round, client, request) on the trainer's device."""
        generator = torch.Generator(device=self.device)
        return generator.manual_seed(derive_seed(self.settings.seed, job.rnd, job.cid, f"dp-sgd-{job.index}"))

    def _dp_step(self, request: Fit, optimizer, live, trainable, xb, yb, index, noise) -> torch.Tensor:
        """One DP-SGD step (pfedkit/privacy/dp_sgd.py): per-sample gradients of the request's loss
        (torch.func), clipped, summed, noised, averaged; then the SGD update. `grad_clip` is not
        applied (the per-sample clip bounds the gradient already)."""
        from pfedkit.privacy.dp_sgd import per_sample_gradients, privatize

        frozen = {name: tensor.detach() for name, tensor in live.items() if name not in trainable}

        def sample_loss(params: Params, x1, y1, i1):
            point = {**frozen, **params}
            features, logits = self.forward(point, x1.unsqueeze(0))
            out = Forward(features.float(), logits.float(), i1.unsqueeze(0))
            return request.loss(out, y1.unsqueeze(0), point, request.context)

        grads, losses = per_sample_gradients(sample_loss, {n: live[n].detach() for n in trainable}, xb, yb, index)
        private = privatize(grads, self.settings.dp_sample_clip, self.settings.dp_sample_noise, noise)
        optimizer.zero_grad(set_to_none=True)
        for name, value in private.items():
            live[name].grad = value.to(live[name].dtype)
        optimizer.step()
        return losses.detach().double().mean()

    def _loss_and_backward(self, request: Fit, optimizer, live, xb, yb, index) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with self._precision():
            features, logits = self.body_and_head(xb)
        out = Forward(features.float(), logits.float(), index)
        loss = request.loss(out, yb, live, request.context)
        loss.backward()
        return loss

    def _precision(self):
        return precision_context(self.settings.precision, self.device)

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
    def _load_momentum(self, optimizer: torch.optim.SGD, live: Params, saved: Params | None) -> None:
        """Resume the client's optimizer: its saved momentum buffers for the trainable tensors."""
        if not saved or not self.settings.momentum:
            return
        for name, tensor in live.items():
            if tensor.requires_grad and name in saved:
                optimizer.state[tensor]["momentum_buffer"] = saved[name].to(self.device, copy=True)

    def _momentum_out(self, optimizer: torch.optim.SGD, live: Params, saved: Params | None) -> Params | None:
        """The optimizer state to keep: buffers of the tensors trained now, the saved ones of the
        tensors this request froze (one optimizer over the whole model, as in PFLlib)."""
        if not (self.settings.keep_optimizer_state and self.settings.momentum):
            return None
        state = dict(saved or {})
        for name, tensor in live.items():
            buffer = optimizer.state.get(tensor, {}).get("momentum_buffer")
            if buffer is not None:
                state[name] = _to_host(buffer)
        return state

    def _set_trainable(self, part: str, live: Params) -> list[str]:
        """Names of the tensors the request trains: the chosen part of the model, and every extra."""
        chosen = []
        for name, tensor in live.items():
            train = part == "all" or name.startswith(part + ".") or name not in self.parameters
            tensor.requires_grad_(train)
            if train:
                chosen.append(name)
        return chosen

    def _params_out(self, live: Params) -> Params:
        return {name: _to_host(t) for name, t in live.items()}

    def _buffers_out(self) -> Params | None:
        if not self.buffers:
            return None
        return {name: t.detach().clone() if self.device.type == "cpu" else t.detach().cpu()
                for name, t in self.buffers.items()}


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy of `tensor` (a new tensor also on the CPU: results never alias the model)."""
    if tensor.device.type == "cpu":
        return tensor.detach().clone(memory_format=torch.contiguous_format)
    return tensor.detach().to("cpu", memory_format=torch.contiguous_format)


def compiled(forward: Callable) -> Callable:
    """`torch.compile(forward)` (inductor). Dropout masks are drawn as in eager mode
    (`fallback_random`), so a compiled run differs from an eager one only by floating-point
    rounding of the fused kernels."""
    import torch._inductor.config as inductor_config

    inductor_config.fallback_random = True
    return torch.compile(forward)


class _Tools:
    """`StepTools` for a custom local step, over one LocalTrainer's model."""

    def __init__(self, trainer: LocalTrainer, request: Fit, live: Params, trainable: list[str],
                 saved: Params | None = None) -> None:
        self.trainer, self.request, self.params, self.trainable = trainer, request, live, trainable
        self.lr = request_lr(request, trainer.settings)
        keep = trainer.settings.keep_optimizer_state and trainer.settings.momentum
        self.momentum: Params = {name: value.to(trainer.device, copy=True)
                                 for name, value in (saved or {}).items()} if keep else {}
        self.stepped = False  # whether the step went through sgd_step

    def sgd_step(self, grads: Params, lr: float) -> None:
        """The config's SGD update on the live params with `grads` and step size `lr`, as the plain
        training path does it: grads clipped to a total norm of `grad_clip` (torch's
        clip_grad_norm_: coef = min(1, clip / (norm + 1e-6))), then weight decay g + wd p, then
        momentum b <- m b + g (b = g at the first step), p <- p - lr b."""
        settings = self.trainer.settings
        names = list(grads)
        with torch.no_grad():
            if settings.grad_clip is not None and names:
                grads = clip_by_total_norm(grads, settings.grad_clip)
            for name in names:
                direction = grads[name]
                if settings.weight_decay:
                    direction = direction + settings.weight_decay * self.params[name]
                if settings.momentum:
                    buffer = self.momentum.get(name)
                    buffer = direction.clone() if buffer is None else buffer.mul_(settings.momentum).add_(direction)
                    self.momentum[name] = direction = buffer
                self.params[name].add_(direction, alpha=-lr)
        self.stepped = True

    def optimizer_state_out(self, saved: Params | None) -> Params | None:
        """The momentum buffers to keep (config keep_optimizer_state), when the step used sgd_step."""
        settings = self.trainer.settings
        if not (self.stepped and settings.keep_optimizer_state and settings.momentum):
            return None
        return {**(saved or {}), **{name: _to_host(value) for name, value in self.momentum.items()}}

    def loss_and_grad(self, batch: Batch, at: Params | None = None,
                      wrt: list[str] | None = None) -> tuple[torch.Tensor, Params]:
        at = self.params if at is None else at
        wrt = self.trainable if wrt is None else wrt
        point = {name: (t.detach().requires_grad_(True) if name in wrt else t.detach()) for name, t in at.items()}
        with torch.enable_grad():
            features, logits = self.trainer.forward(point, batch.x)
            out = Forward(features.float(), logits.float(), batch.index)
            loss = self.request.loss(out, batch.y, point, self.request.context)
            grads = torch.autograd.grad(loss, [point[n] for n in wrt], allow_unused=True)
        return loss.detach(), {n: (torch.zeros_like(point[n]) if g is None else g) for n, g in zip(wrt, grads)}
