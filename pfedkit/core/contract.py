"""The Algorithm contract: server math + client math over explicit state and messages.

An algorithm never owns a round loop. The engine (`pfedkit.engine.simulate`) calls, each round:

    reports = {cid: algo.client_report(rnd, cid, ...)}            # optional upload before the broadcast
    server = algo.collect(rnd, server, reports)                    # (only if some client reported)
    messages = algo.broadcast(rnd, server, participants)          # what each client downloads
    for each participant (in lock-step, so a runtime can batch them):
        gen = algo.client_update(rnd, cid, client_state, message, data)
        params = yield Fit(...)   # a training request; the runtime answers with trained params
        ... return new_client_state, reply_message
    server = algo.aggregate(rnd, server, replies)   # through start_aggregation: fed reply by reply
    model used by client cid = algo.client_model(cid, server, client_state)   # for evaluation
    (or its own prediction from the inputs: algo.predict_inputs(cid, server, client_state, x, buffers))

Before round 1 the engine asks EVERY client for `client_report(0, ...)`: the setup-time exchange
(round 0) for what a method sends once before training (DA-PFL's class counts); its bytes are
counted in round-0 rows of the metrics and in the summary's `bytes_setup`.

Because `client_update` *yields* `Fit` requests instead of training, the same definition runs in
the sequential trainer, in worker processes and (later) vectorized or over Flower. Messages are
plain dicts of tensors/arrays/numbers so the engine can count their bytes and ship them; state is
whatever the algorithm keeps (dicts of tensors), checkpointed as is. Keep client state compact:
only what the client really keeps between rounds (FedAvg keeps nothing).
"""
from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar, Literal, NamedTuple, Protocol, get_args

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict

from pfedkit.core.aggregation import Aggregation, CollectReplies
from pfedkit.core.model_ops import ModelOps
from pfedkit.core.params import Params

Message = dict[str, Any]


class Forward(NamedTuple):
    """What a loss sees of the model's forward pass on a mini-batch."""
    features: torch.Tensor  # body output h, [B, d]
    logits: torch.Tensor    # head output z, [B, C]
    # Positions of the batch's samples in the client's training set, [B] int64: lets a loss read
    # per-sample context (e.g. a frozen teacher's logits computed once per Fit) as context[...][index].
    index: torch.Tensor | None = None


# A loss is a pure function of (forward output, labels, live parameters, request context). Use
# module-level functions (with functools.partial for hyperparameters) so that requests can be
# sent to worker processes.
LossFn = Callable[[Forward, torch.Tensor, Params, Mapping[str, Any]], torch.Tensor]


def cross_entropy(out: Forward, y: torch.Tensor, params: Params, context: Mapping[str, Any]) -> torch.Tensor:
    """Mean cross-entropy over the mini-batch."""
    return F.cross_entropy(out.logits, y)


@dataclass
class Fit:
    """A request to train `params` on the client's own training data.

    trainable: "all", "body" or "head" (the rest stays frozen but is still used in the forward);
    "none": the whole model is frozen and only `extra` trains (R-pFedPM's relation module).
    epochs / steps: local epochs (None: the config's local_epochs) or an exact number of
    mini-batches. lr: None uses the config's lr. context: tensors the loss reads (anchors,
    prototypes...), kept as given. optimizer: which of the client's optimizers trains this request;
    with the config's `keep_optimizer_state` each named optimizer's state (SGD momentum buffers)
    is kept per client across rounds and requests (one optimizer per client for the whole run, as
    in PFLlib-based code); a method training two models (Ditto's personal and global model) names
    one optimizer per model.

    extra: tensors trained or carried beside the model (FedRoD's personal head, APFL's personal
    model and mixing weight, pFedMe's local copy), named without a `body.`/`head.` prefix. The
    loss sees them in `params` next to the model's parameters; the default SGD step trains them
    (whatever `trainable` says), a custom step updates them as it likes. The answer to the request
    holds the model's parameters and the final `extra` tensors, by the same names. An extra the
    loss does not differentiate gets no gradient, so SGD carries it unchanged (no momentum, decay
    or clipping touches it); the loss may update such a tensor in place through `.detach()`, as
    BatchNorm updates its running statistics in train mode (R-pFedPM's relation module), and the
    answer holds its final value.
    samples: positions in the client's training set to train on (FedFomo keeps a validation
    split out of training); None: all of them. Epochs and batches are over these samples, and
    `Forward.index` / `Batch.index` still give positions in the whole training set.
    drop_last: whether each epoch's last, incomplete mini-batch is dropped; None: the config's
    `drop_last` (FedALA's weight learning keeps it, as its authors' loader does).
    step: a custom local step (`LocalStep`) replacing plain SGD on the loss: Per-FedAvg's meta step,
    pFedMe's inner solve, APFL's three updates. It is called with `batches_per_step` consecutive
    mini-batches of the request's batch schedule (an incomplete last group is dropped). Custom
    steps do their own updates: the config's momentum, weight decay and gradient clipping do not
    apply to them, and the vectorized runtime runs them with the sequential trainer.
    """
    params: Params
    loss: LossFn = cross_entropy
    trainable: str = "all"
    epochs: int | None = None
    steps: int | None = None
    lr: float | None = None
    context: dict[str, Any] = field(default_factory=dict)
    optimizer: str = "default"
    extra: Params = field(default_factory=dict)
    samples: torch.Tensor | None = None
    drop_last: bool | None = None
    step: LocalStep | None = None
    batches_per_step: int = 1

    def __post_init__(self) -> None:
        clash = [name for name in self.extra if name.startswith(("body.", "head."))]
        if clash:
            raise ValueError(f"Fit.extra names must not start with 'body.' or 'head.' (model names): {clash[:3]}")
        if self.batches_per_step < 1:
            raise ValueError(f"Fit.batches_per_step must be >= 1, got {self.batches_per_step}")
        if self.trainable not in ("all", "body", "head", "none"):
            raise ValueError(f"Fit.trainable must be 'all', 'body', 'head' or 'none', got {self.trainable!r}")
        if self.trainable == "none" and not self.extra:
            raise ValueError("Fit.trainable='none' freezes the model and trains only Fit.extra, which is empty here; "
                             "pass the tensors to train in extra, or choose 'all', 'body' or 'head'")
        if self.samples is not None:
            self.samples = torch.as_tensor(self.samples, dtype=torch.int64)
            if self.samples.dim() != 1 or (self.samples < 0).any():
                raise ValueError("Fit.samples must be a 1-D tensor of non-negative positions in the training set")
        for name in ("epochs", "steps", "lr"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"Fit.{name} must be >= 0 or None (the config's value), got {value!r}")


ClientUpdate = Generator[Fit, Params, tuple[Any, Message]]


class Batch(NamedTuple):
    """One mini-batch of the client's training data, as a custom local step receives it."""
    x: torch.Tensor
    y: torch.Tensor
    index: torch.Tensor  # positions in the client's training set


class StepTools(Protocol):
    """What a custom local step (`Fit.step`) may use; the runtime's trainer provides it.

    `params` holds the live tensors: the model's parameters (by name) and the request's `extra`
    tensors. A step changes them in place (under `torch.no_grad()`); the trainer returns their
    final values. `loss_and_grad` evaluates the request's loss (with the request's context) on a
    batch at any parameter values, in train mode (BatchNorm statistics are updated, dropout drawn
    from the trainer's seeded generator), and returns the loss and its gradient."""
    params: Params
    trainable: list[str]  # the model parameters the request's `trainable` part selects
    lr: float

    def loss_and_grad(self, batch: Batch, at: Params | None = None,
                      wrt: list[str] | None = None) -> tuple[torch.Tensor, Params]:
        """(loss, {name: d loss / d at[name]}) at `at` (default: the live params) for the names in
        `wrt` (default: `trainable`)."""
        ...

    def sgd_step(self, grads: Params, lr: float) -> None:
        """Update the live params by `grads` with the config's SGD settings (grad_clip, weight
        decay, momentum; the momentum kept per client with keep_optimizer_state), as plain
        training does. A step that updates the params itself gets none of them."""
        ...


# A custom local step: given the tools and `Fit.batches_per_step` consecutive mini-batches, update
# `tools.params` in place and return the step's loss (a float). A module-level function (with
# functools.partial for hyperparameters) so that requests can go to worker processes.
LocalStep = Callable[[StepTools, list[Batch]], float]


# How the model a client is evaluated with is assembled (`Algorithm.evaluated_model`):
#   "global": the server's n_i-weighted mean of the round's trained models (FedAvg, FedProx, MOON);
#   "own": the model the client's own latest training returned (Local, DA-PFL, FedAMP, FeSEM);
#   "shared_body": the mean of the trained bodies + the client's own trained head (FedPer, FedRep);
#   "shared_head": the mean of the trained heads + the client's own trained body (LG-FedAvg);
#   "custom": anything else (a mixture, adaptation, a custom prediction): the method's own rule.
EvaluatedModel = Literal["global", "own", "shared_body", "shared_head", "custom"]
EVALUATED_MODELS: tuple[str, ...] = get_args(EvaluatedModel)


class HyperParams(BaseModel):
    """The base of every method's `Hyper` (its config section): a key the method does not declare
    is refused (with "did you mean"). A method without options of its own keeps this one."""
    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class ClientData:
    """One client's data, in memory. Index arrays into the dataset are saved with the run."""
    cid: int
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    class_counts: np.ndarray  # training samples per class, [C]
    # The engine sets this when it runs client_update: it returns the client's CURRENT BatchNorm
    # statistics (updated by each of its Fit requests), see `buffers`.
    buffers_source: Callable[[], Any] | None = field(default=None, repr=False, compare=False)

    @property
    def buffers(self) -> dict[str, torch.Tensor] | None:
        """The client's own model buffers (BatchNorm running statistics) as they are now, after its
        latest Fit; None for models without buffers. Use them for any forward pass on the client's
        model outside training (features, prototypes, teacher logits): `ops.features(p, x, data.buffers)`."""
        return self.buffers_source() if self.buffers_source is not None else None

    @property
    def n_train(self) -> int:
        return int(self.y_train.shape[0])

    @property
    def n_test(self) -> int:
        return int(self.y_test.shape[0])


@dataclass(frozen=True)
class Setup:
    """What an algorithm knows about the federation when it is built."""
    num_clients: int
    num_classes: int
    train_counts: np.ndarray  # [N, C] training samples per client and class
    seed: int
    local_epochs: int
    ops: ModelOps  # functional forward of the run's model, for server-side math
    # Heterogeneous models (config `client_model_options`): client cid's ModelOps; None: all use `ops`.
    client_ops: tuple[ModelOps, ...] | None = None
    rounds: int = 0  # the run's number of rounds (FedPFA switches phase half way); 0: unknown

    def ops_for(self, cid: int) -> ModelOps:
        """The ModelOps of client `cid`'s architecture (`ops`, the default one, unless models differ)."""
        return self.ops if self.client_ops is None else self.client_ops[cid]


class Algorithm:
    """One federated method: server math + client math over explicit state (module docstring).

    What every method writes (the worked examples: algorithms/fedavg.py, a mean of uploads, and
    algorithms/fedrep.py, a shared body with a private head trained first):
      - `name` (its config value `algorithm=`), `description` (one line for `pfedkit list`) and,
        when it has options, `Hyper` (a `HyperParams`: its config section `NAME:`);
      - `init_server`, `init_client`: the server's and a client's state from the initial weights;
      - `broadcast`: what each participant downloads;
      - `client_update`: a generator that yields `Fit` requests and returns (new state, reply);
      - `aggregate`: the new server state from the round's replies (or the `MeanOfUploads` mixin
        with `averaged = "KEY"` for the n_i-weighted mean of the uploads);
      - `client_model`: the parameters a client predicts with (what evaluation measures).
    Everything below those is optional, grouped by concept: evaluation (a custom prediction from
    the features or from the inputs, the model right after training, evaluation-time adaptation), the setup exchange (an upload before
    the broadcast), clients that never trained, a streamed aggregation, checks of the options
    against the model and data, the engine hints and what tests and tools read (class attributes).
    """
    # --- what every method declares ---------------------------------------------------------------
    name: ClassVar[str]
    description: ClassVar[str] = ""
    Hyper: ClassVar[type[HyperParams]] = HyperParams

    # --- engine hints (optional) -------------------------------------------------------------------
    head: ClassVar[str] = "last"  # which layers form the head: "last" Linear or all "fc" layers
    # other head splits the algorithm's math works with (config `head_split`); None: `head` only
    head_splits: ClassVar[tuple[str, ...] | None] = None
    # True when clients may use different architectures (config `client_model_options`): the
    # algorithm never averages or mixes parameters across clients and uses `setup.ops_for(cid)`.
    supports_heterogeneous_models: ClassVar[bool] = False
    # Options this method had and removed: {option: why, and what to set instead}. A config that
    # still sets one is refused with that text (before torch is imported: pfedkit.catalog).
    removed_options: ClassVar[dict[str, str]] = {}
    # torch threads for this algorithm's OWN code in a round: each step of `client_update` (the
    # code between its Fits) and the aggregation (`start_aggregation`'s `add` and `finish`, hence
    # `aggregate`). For code made of thousands of tiny ops, which one thread runs fastest (CReFF's
    # gradient draws, feature matching and classifier re-training: several threads cost ~50x per op
    # in spin-up on a busy machine). The engine applies it around those calls only (the runtime's
    # Fits and evaluations keep the run's count); a fixed count, so the numbers do not depend on
    # the backend either. None (the default): the run's count (`threads`).
    small_op_threads: ClassVar[int | None] = None

    # --- what tests and tools read (declared; the engine never reads them) -------------------------
    # Which standard assembly gives the model a client is evaluated with (its docs page's "Evaluated
    # model"): one of EVALUATED_MODELS. tests/test_evaluated_model.py rebuilds that model from what
    # the engine saw, independently of the algorithm, and checks the run evaluated it; "custom" means
    # the test holds a rule of the method's own under its name. None: undeclared (that test fails
    # and says to declare it). A subclass inherits its parent's: declare it again where
    # `client_model` (or `predict`, `adapt`) assembles another model.
    evaluated_model: ClassVar[EvaluatedModel | None] = None
    # Options (fields of `Hyper`) that keep the generic tests' short runs on the embedded digits set
    # fast without leaving out a code path (fewer head epochs, a shorter server loop): e.g. FedRep's
    # {"head_epochs": 1}. The generic tests (every backend, evaluated model, resume, new clients,
    # DP, figures: tests/conftest.py `quick_options`) run the method with them; {}: its defaults.
    quick_test_options: ClassVar[dict[str, Any]] = {}

    def __init__(self, hyper: HyperParams, setup: Setup) -> None:
        self.hyper = hyper  # the validated options (`Hyper`)
        self.setup = setup
        self.diagnostics: dict[str, dict[int, Any]] = {}  # replaced by the engine's checkpointed dict

    # --- the hooks every method writes -------------------------------------------------------

    def init_server(self, params: Params) -> Any:
        """The server's state before round 1 from the initial weights `params` (FedAvg: the
        model; Local: None). Checkpointed as is: keep it to tensors, numbers and dicts/lists."""
        return None

    def init_client(self, cid: int, params: Params) -> Any:
        """Client `cid`'s state before its first round from its initial weights (None: it keeps
        nothing between rounds, as FedAvg's clients)."""
        return None

    def broadcast(self, rnd: int, server: Any, cids: list[int]) -> dict[int, Message]:
        """What each participant downloads. A method whose server decisions depend on the round's
        participants (FeSEM's E/M step) may update the server state (a dict) in place here: the
        engine checkpoints the server state after the round."""
        return {cid: {} for cid in cids}

    def client_update(self, rnd: int, cid: int, client: Any, message: Message, data: ClientData) -> ClientUpdate:
        """Client `cid`'s round: `params = yield Fit(...)` for each local training (the engine
        answers with the trained parameters), then `return new_client_state, reply` (a dict of
        tensors and numbers: what it uploads, counted in bytes)."""
        raise NotImplementedError

    def aggregate(self, rnd: int, server: Any, replies: dict[int, Message]) -> Any:
        """The new server state from the round's replies ({cid: reply}, in client order)."""
        return server

    def client_model(self, cid: int, server: Any, client: Any) -> Params:
        """The parameters client `cid` would predict with now (what evaluation measures)."""
        raise NotImplementedError

    # --- evaluation (optional) ---------------------------------------------------------------

    def predict(self, cid: int, server: Any, client: Any, features: torch.Tensor) -> torch.Tensor | None:
        """Logits from body features when the client does NOT predict with the model's own head
        (FedProto's nearest prototype, R-pFedPM's relation scores). None: use the head."""
        return None

    def has_custom_predict(self) -> bool:
        return type(self).predict is not Algorithm.predict

    def predict_inputs(self, cid: int, server: Any, client: Any, x: torch.Tensor,
                       buffers: Params | None = None) -> torch.Tensor:
        """Logits (or log-probabilities: only their argmax and cross-entropy are measured) computed
        from the test inputs `x` themselves, when the client predicts with something no single
        parameter set with its head or `predict` expresses (FedEM's mixture of K full models).
        `buffers`: the client's BatchNorm statistics as evaluation would load them (None: no
        buffers). Not overridden (the default): the engine evaluates `client_model` (through
        `predict` where there is one). Where overridden it replaces both for every evaluation
        (participants, either `eval_point`, new clients) and the parameters `client_model` /
        `adapt` give are still built, recorded and measured for row norms, but not predicted with.
        Runs in the main process on every backend, as `predict`."""
        raise NotImplementedError

    def has_input_predict(self) -> bool:
        return type(self).predict_inputs is not Algorithm.predict_inputs

    def evaluation_state(self, cid: int, server: Any, client: Any, params: Params, data: ClientData) -> Any:
        """The state client `cid` predicts with at this evaluation (the `client` that `predict` and
        `predict_inputs` then read), computed on its side from its data and `params`, the model the
        evaluation measures (after `adapt`, or a newcomer's fine-tuning); `data.buffers` are the
        BatchNorm statistics it is measured with. kNN-Per's datastore: the training set embedded by
        the very model that predicts. Nothing is kept: the next evaluation starts again from the
        stored state. Default: `client` itself."""
        return client

    def trained_model(self, cid: int, client: Any, params: Params) -> Params:
        """What a participant predicts with right after its local training (config
        `eval_point=after_local_training`): `client` is its new state, `params` the answer to its
        last Fit. Default: that answer (APFL mixes it with the personal model)."""
        return params

    def adapt(self, cid: int, server: Any, client: Any, params: Params) -> Fit | None:
        """Evaluation-time adaptation (FedBABU's fine-tuning, Per-FedAvg's one step): a Fit request
        on the client's training data starting from `params`, the model evaluation would measure.
        The engine runs it before each evaluation (seeded apart from training), evaluates the
        adapted model and then throws it away: nothing is written back into client or server
        state, the client's BatchNorm statistics and optimizer state included. None: evaluate
        `params` as they are (the default)."""
        return None

    def has_adaptation(self) -> bool:
        return type(self).adapt is not Algorithm.adapt

    # --- the setup exchange: an upload before the broadcast (optional) -----------------------

    def client_report(self, rnd: int, cid: int, client: Any, data: "ClientData") -> Message | None:
        """What client `cid` uploads BEFORE the round's broadcast (None: nothing, the default).

        rnd = 0: the one-off setup exchange, asked of every client before round 1. rnd >= 1: asked
        of the round's participants (DA-PFL's current models w_j^{t-1}). Read-only: the client
        state is not changed here. Bytes are counted as the client's upload of that round."""
        return None

    def has_client_report(self) -> bool:
        """Whether clients ever send a `client_report` (a Flower server skips asking otherwise)."""
        return type(self).client_report is not Algorithm.client_report

    def collect(self, rnd: int, server: Any, reports: dict[int, Message]) -> Any:
        """The server receives the round's `client_report` messages (called only when some client
        reported); returns the new server state. Anything kept only for this round should be
        dropped again in `aggregate`, so checkpoints and memory do not grow with it."""
        return server

    # --- clients that never trained (config `new_clients`, optional) -------------------------

    def new_client_refusal(self) -> str | None:
        """Why this algorithm cannot give a model to a client that never trained (config
        `new_clients`), in a few words; None (the default): it can, through `joining_model`. The
        engine refuses `new_clients > 0` at start with a one-line ConfigError naming both."""
        return None

    def joining_state(self, cid: int, server: Any, client: Any, data: ClientData) -> Any:
        """The state client `cid`, which never trained, holds when it joins now, from its fresh
        state `client` (`init_client`) and its data: what `joining_model` and the evaluation's
        `predict` / `predict_inputs` then read (FedEM's mixture weights fitted by EM with the
        components fixed). Nothing is kept: the next evaluation starts again from the fresh state.
        Default: `client` itself."""
        return client

    def joining_model(self, cid: int, server: Any, client: Any, data: ClientData) -> Params:
        """What client `cid`, which never trained and was never aggregated, receives when it joins
        now: the model it starts from (then `new_client_finetune` epochs of SGD on its training
        split, then evaluation on its test split). `client` is its fresh state (`init_client`),
        `data` its data (a method whose choice reads the client's data, as IFCA's lowest-loss
        cluster, computes it here, on the client's side). Nothing written here is kept.

        Default: `client_model` with that fresh state, which is the global model for methods with
        one (FedAvg, FedProx, MOON, pFedMe before the first participation...), the shared part with
        the client's initial private part for partial sharing (FedPer, FedRep, LG-FedAvg, FedBABU,
        FedRoD), and the initial model where nothing model-shaped is shared (Local). A method whose
        `client_model` reads a personal model that a newcomer does not have returns the server's
        model instead (Ditto, APFL) or refuses (`new_client_refusal`)."""
        return self.client_model(cid, server, client)

    # --- a streamed aggregation, checks, diagnostics (optional) ------------------------------

    def start_aggregation(self, rnd: int, server: Any, cids: list[int]) -> Aggregation:
        """How the server receives round `rnd`'s replies from the participants `cids`: an object
        fed each reply as it comes (`add`) that returns the new server state (`finish`). Default:
        keep them all and call `aggregate`. A method whose aggregate is a running sum returns one
        that folds each reply and drops it (`pfedkit.core.aggregation`), so the server's
        memory does not grow with the number of participants."""
        return CollectReplies(partial(self.aggregate, rnd, server))

    def check(self) -> None:
        """Raise `pfedkit.config.ConfigError` when an option does not fit the run's model or data
        (one line: the option, the limit, the fix). Called once before the run directory exists."""

    def record(self, rnd: int, key: str, value: Any) -> None:
        """Keep what the algorithm decided this round (a matrix, a selection...) for reports.

        Stored in the run directory's diagnostics.pt as {key: {round: value}} and checkpointed,
        so a resumed run keeps them. Use numpy arrays or plain Python values. Algorithms only
        record; `pfedkit report` draws them (pfedkit/report/methods/<algorithm module>.py).
        """
        self.diagnostics.setdefault(key, {})[rnd] = value


def message_bytes(message: Any) -> int:
    """Bytes a message carries: tensor/array payloads, 8 bytes per Python number."""
    if message is None:
        return 0
    if isinstance(message, torch.Tensor):
        return message.numel() * message.element_size()
    if isinstance(message, np.ndarray):
        return int(message.nbytes)
    if isinstance(message, (bool, int, float, np.number)):
        return 8
    if isinstance(message, Mapping):
        return sum(message_bytes(value) for value in message.values())
    if isinstance(message, (list, tuple)):
        return sum(message_bytes(value) for value in message)
    if isinstance(message, str):
        return len(message.encode())
    raise TypeError(f"cannot count the bytes of a {type(message).__name__} in a message")
