"""Typed run configuration: YAML file + `key=value` overrides, validated with clear messages.

Every key a script may rely on is a field here. Each algorithm's own hyperparameters live in a
section named after it (`fedprox: {mu: 0.01}`, or `fedprox.mu=0.01` on the command line) and are
validated by that algorithm's `Hyper` model. Anything wrong ends in a `ConfigError` whose single
line names the key, says what was wrong and what is allowed (and the closest allowed name to a
misspelt one). What runs, but not as written (another algorithm's options, a value lowered to
what is possible), gives a `ConfigWarning`, which the command line prints as one line. A loaded
Config holds what is in effect: the resolved model, the running algorithm's section only.

Names (algorithms, their options, models) are checked against `pfedkit.catalog` first, so a
misspelt key is refused without importing torch; the running algorithm's `Hyper` then validates
the values. YAML is read through `parse_yaml` / `read_yaml_file`: a file that is not UTF-8 or is
nested too deeply is a one-line error like invalid YAML. `config_keys` lists every key with its
default and description (`pfedkit config`).
"""
from __future__ import annotations

import warnings
from collections.abc import Collection
from importlib import resources
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from pfedkit.catalog import catalog
from pfedkit.core.backends import BACKENDS
# The errors live on the ground floor (every layer raises them); they are part of this module's API.
from pfedkit.core.errors import ConfigError, ConfigWarning, did_you_mean  # noqa: F401

# The `backend` values: the names of `pfedkit.build.RUNTIMES`, kept in core/backends.py.
Backend = Literal[BACKENDS]

PartitionScheme = Literal["iid", "dirichlet", "dirichlet_client", "pathological", "shards",
                          "group_dominant", "nway_kshot", "natural"]

# Which partition-config fields each scheme passes to `pfedkit.data.partition.partition`.
SCHEME_PARAMS: dict[str, tuple[str, ...]] = {
    "iid": ("samples_per_client",),
    "dirichlet": ("alpha", "least", "max_tries"),
    "dirichlet_client": ("alpha", "samples_per_client"),
    "pathological": ("classes_per_client", "balanced"),
    "shards": ("shards_per_client",),
    "group_dominant": ("s", "samples_per_client"),
    "nway_kshot": ("n", "k", "n_noise", "k_noise"),
    "natural": (),  # one client per writer (the dataset's writer ids); num_clients < writers: a seeded sample
}


class PartitionConfig(BaseModel):
    """How the pool is split over clients (settings.md §1) and how each client's test set is made."""
    model_config = ConfigDict(extra="forbid")

    scheme: PartitionScheme = "dirichlet"
    pool_fraction: float = Field(1.0, gt=0, le=1, description="partition a seeded class-stratified fraction of "
                                 "the pool (the official training split for official test splits): quick runs")
    alpha: float = Field(0.5, gt=0, description="Dirichlet concentration (smaller = more skew)")
    least: int | None = Field(None, ge=1, description="dirichlet: minimum client size (None: PFLlib rule)")
    max_tries: int = Field(1000, ge=1, description="dirichlet: draws before giving up on `least` (PFLlib "
                           "retries without limit; alpha 0.01 with 20 clients needs ~3,000 on CIFAR-10)")
    classes_per_client: int = Field(2, ge=1, description="pathological: classes per client")
    balanced: bool = Field(False, description="pathological: equal shares instead of random sizes")
    shards_per_client: int = Field(2, ge=1, description="shards: label-sorted shards each client gets")
    s: float = Field(0.2, ge=0, le=1, description="group_dominant: IID fraction")
    n: int = Field(3, ge=1, description="nway_kshot: mean number of classes (ways)")
    k: int = Field(100, ge=1, description="nway_kshot: mean samples per class (shots)")
    n_noise: int = Field(1, ge=0, description="nway_kshot: the ways vary by up to this much around n")
    k_noise: int = Field(1, ge=0, description="nway_kshot: the shots vary by up to this much around k")
    samples_per_client: int | None = Field(None, ge=1, description="iid, dirichlet_client, group_dominant: "
                                           "samples per client (None: the pool shared out)")
    train_ratio: float = Field(0.75, gt=0, lt=1, description="per-client train share (per_client split)")
    stratified: bool = Field(True, description="per-client split keeps each class's ratio [ours]")
    test_split: Literal["auto", "per_client", "official_fraction", "official_shots"] = Field(
        "auto", description="auto: official_shots for nway_kshot, per_client otherwise")
    test_fraction: float = Field(0.1, gt=0, le=1, description="official_fraction: DA-PFL's 10% per class")
    test_shots: int = Field(40, ge=1, description="official_shots: test images per class of a client")

    def resolved_test_split(self) -> str:
        if self.test_split != "auto":
            return self.test_split
        return "official_shots" if self.scheme == "nway_kshot" else "per_client"

    def scheme_params(self) -> dict[str, Any]:
        params = {name: getattr(self, name) for name in SCHEME_PARAMS[self.scheme]}
        return {k: v for k, v in params.items() if v is not None}


class HeadlineConfig(BaseModel):
    """Which number a run's summary and tables lead with (settings.md §4.2-4.3); all are stored."""
    model_config = ConfigDict(extra="forbid")

    weighting: Literal["weighted", "unweighted"] = Field(
        "weighted", description="sample-weighted mean over clients (PFLlib) or unweighted mean (DA-PFL, pFedPM, PFedCS)")
    point: Literal["best", "last5", "last10", "final"] = Field(
        "best", description="best round (chosen on test data), mean of the last 5 / 10 evaluated rounds, or the last")


class RayConfig(BaseModel):
    """`backend=ray` (and Flower simulation, which runs its virtual nodes on Ray)."""
    model_config = ConfigDict(extra="forbid")

    address: str | None = Field(None, description="an existing Ray cluster (e.g. 10.0.0.5:6379 or auto); "
                                "None: start a local Ray for the run")
    gpus_per_worker: float | None = Field(None, ge=0, description="GPUs each actor asks Ray for on a GPU run "
                                          "(fractions share a GPU: 0.5 puts two actors on one); None: 1 with "
                                          "device cuda, 0 on the CPU (device=cpu always uses 0)")


class VectorizedConfig(BaseModel):
    """`backend=vectorized`: how each lock-step of the stacked clients runs (docs/backends.md)."""
    model_config = ConfigDict(extra="forbid")

    step: Literal["auto", "eager", "bucketed", "graphs"] = Field(
        "auto", description="graphs: one CUDA graph captured per (members, batch size) shape and replayed (no "
        "per-step host overhead; members padded to powers of two with sink rows, batch sizes never padded); "
        "bucketed: the same shapes run eagerly (the graphs' twin on a CPU); eager: exact shapes; auto: graphs "
        "on a GPU in fp32 without dropout, else eager")
    max_clients: int | None = Field(None, ge=1, description="clients trained together at most (consecutive "
                                    "chunks of a round's clients, each handed on before the next trains: memory "
                                    "flat in the number of clients); None: a power of two whose stacked models "
                                    "fit in a quarter of the device's memory, at most 4096")


class FlowerConfig(BaseModel):
    """`pfedkit flower simulate` and Flower deployments (see README, Beyond one machine)."""
    model_config = ConfigDict(extra="forbid")

    round_timeout: float = Field(600.0, gt=0, description="seconds the server waits for a step's replies; "
                                 "a node that has not answered by then is left out of that step")
    connect_timeout: float = Field(300.0, gt=0, description="seconds the server waits for all num_clients "
                                   "nodes to connect")
    client_cpus: float = Field(1.0, gt=0, description="simulate: CPUs each virtual node (Ray actor) needs")
    client_gpus: float = Field(0.0, ge=0, description="simulate: GPUs each virtual node (Ray actor) needs "
                               "(0.5: two nodes per GPU); 0 leaves every node on the first GPU with device=auto/cuda")


class DataConfig(BaseModel):
    """Options of datasets read from elsewhere: `dataset=hf:NAME_OR_DIR` (see docs/data.md)."""
    model_config = ConfigDict(extra="forbid")

    image_column: str = Field("image", min_length=1, description="hf: the column holding the images")
    label_column: str = Field("label", min_length=1, description="hf: the column holding the class labels")
    revision: str | None = Field(None, description="hf: the Hub revision (branch, tag or commit) to load; "
                                 "part of the cache key (None: the Hub's default branch, cached once)")


class DPConfig(BaseModel):
    """Differential privacy (docs/privacy.md). `client`: DP-FedAvg (McMahan et al., ICLR 2018): each
    participant's update is clipped to `clip` and Gaussian noise of std noise_multiplier * clip / m is
    added to the uniform mean of m updates. `sample`: DP-SGD in local training (per-sample clipping
    to `sample_clip`, noise `sample_noise_multiplier`). epsilon for `delta` is reported per round."""
    model_config = ConfigDict(extra="forbid")

    level: Literal["none", "client", "sample"] = Field("none", description="none, client (DP-FedAvg: "
                                                       "clip + noise the aggregate) or sample (DP-SGD locally)")
    clip: float = Field(1.0, gt=0, description="client level: L2 bound on each client's model update")
    noise_multiplier: float = Field(1.0, ge=0, description="client level: noise std / (clip / m); "
                                    "participants=poisson: / (clip / (join_ratio * N))")
    sample_clip: float = Field(1.0, gt=0, description="sample level: L2 bound on each sample's gradient")
    sample_noise_multiplier: float = Field(1.0, ge=0, description="sample level: noise std / sample_clip")
    delta: float = Field(1e-5, gt=0, lt=1, description="the delta of the (epsilon, delta) reported")
    target_epsilon: float | None = Field(None, gt=0, description="stop before a round that would exceed it")
    accountant: Literal["rdp", "prv"] = Field("rdp", description="rdp or prv (Opacus, Poisson sampling: "
                                              "sample level, and client level with participants=poisson); client "
                                              "level with fixed-size sampling: rdp only (dp_accounting's RDP "
                                              "analysis of sampling without replacement)")
    replace_batchnorm: bool = Field(False, description="sample level: the model's BatchNorm layers become "
                                    "GroupNorm (DP-SGD needs per-sample gradients; BatchNorm mixes samples)")


class Config(BaseModel):
    """One run. Defaults give the embedded job: FedAvg on `digits`, 10 clients, Dirichlet 0.5."""
    model_config = ConfigDict(extra="allow")  # extra keys must be algorithm sections (checked below)

    algorithm: str = Field("fedavg", description="the method (pfedkit list); its options: ALGORITHM.KEY=VALUE")
    dataset: str = Field("digits", description="a dataset of pfedkit list, or hf:NAME_OR_DIR (docs/data.md)")
    model: str = Field("auto", description="auto: the dataset's default model")
    model_options: dict[str, Any] = Field(default_factory=dict, description="keyword options of the model "
                                          "(pfedkit list: models), e.g. {c2: 18}")
    client_model_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description='heterogeneous models: {"0-6": {"c2": 18}, ...} merged over '
        "model_options for those clients (only algorithms that never average parameters)")
    init_weights: str | None = Field(
        None, description="a file of the model's initial weights (torch.save of {name: tensor}: every "
        "parameter, named as the run's model names it, body.conv1.weight, or without body./head., "
        "conv1.weight), read with weights_only; None: the seeded initialisation")
    partition: PartitionConfig = Field(default_factory=PartitionConfig)
    num_clients: int = Field(10, ge=1, description="clients the data is partitioned over")
    join_ratio: float = Field(1.0, gt=0, le=1, description="share of the clients taking part in each round")
    participants: Literal["round", "floor", "poisson"] = Field(
        "round", description="clients per round: round(join_ratio * N), or int(join_ratio * N) (PFLlib), drawn "
        "without replacement; poisson: each client joins independently with probability join_ratio")
    new_clients: int = Field(0, ge=0, description="clients (chosen with the seed) that never train and are "
                             "never aggregated: each evaluation, they receive what a joining client would and "
                             "are evaluated (generalisation to new clients); join_ratio applies to the others")
    new_client_finetune: int = Field(0, ge=0, description="local epochs a new client trains on its own training "
                                     "split from what it received before it is evaluated (0: evaluated as received)")
    rounds: int = Field(20, ge=1, description="communication rounds")
    head_split: Literal["last", "fc"] | None = Field(
        None, description="which layers form the head: the last Linear or all fully connected layers, for "
        "algorithms that allow a choice (FedPer, FedRep, LG-FedAvg, FedBABU, FedPAC); None: the algorithm's own")
    local_epochs: int = Field(1, ge=1, description="passes over its training split a client makes per round")
    local_steps: int | None = Field(None, ge=1, description="exactly this many mini-batch steps per client and "
                                    "round instead of local_epochs epochs (batches drawn pass by pass, each pass "
                                    "reshuffled); a method's own phases that name their epochs keep them")
    batch_size: int = Field(10, ge=1, description="mini-batch size of local training")
    lr: float = Field(0.05, gt=0, description="SGD learning rate (papers: 0.005-0.01; set it per preset)")
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum")
    weight_decay: float = Field(0.0, ge=0, description="SGD weight decay (L2 penalty)")
    grad_clip: float | None = Field(None, gt=0, description="clip the gradient norm at this value")
    drop_last: bool = Field(False, description="drop each epoch's last, incomplete mini-batch")
    keep_optimizer_state: bool = Field(False, description="keep each client's SGD momentum across rounds and "
                                       "Fit requests (PFLlib-style: one optimizer per client for the run)")
    seed: int = Field(0, description="seeds every draw: partition, sampling, initialisation, batches")
    eval_every: int = Field(1, ge=1, description="evaluate every this many rounds (and after the last)")
    eval_point: Literal["after_download", "after_local_training"] = Field(
        "after_download", description="evaluate the model a client would use after the round (what it "
        "downloads next; PFLlib) or a participant's model right after its local training (DA-PFL)")
    headline: HeadlineConfig = Field(default_factory=HeadlineConfig)
    validation_fraction: float = Field(0.0, ge=0, lt=1, description="share of each client's training split carved out (seeded, stratified) as a validation split: removed from training and evaluated instead of the test split, which is then never read (pfedkit tune; 0: off)")
    dp: DPConfig = Field(default_factory=DPConfig)
    backend: Backend = Field("sequential", description="how a round's clients train: one after another, in "
                             "worker processes, as one batched computation, or on Ray")
    workers: int | None = Field(None, ge=1, description="processes / ray backend: worker count (default: "
                                "cores; ray: the cluster's CPUs)")
    ray: RayConfig = Field(default_factory=RayConfig)
    vectorized: VectorizedConfig = Field(default_factory=VectorizedConfig)
    flower: FlowerConfig = Field(default_factory=FlowerConfig)
    threads: int | None = Field(None, ge=1, description="torch threads per client update (default: all cores for sequential, 1 per worker)")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="where clients train and are "
                        "evaluated: cpu, cuda, cuda:N, or auto (the first GPU for backend=sequential/vectorized when "
                        "torch sees one, else the CPU)")
    precision: Literal["fp32", "bf16"] = Field("fp32", description="bf16: autocast where the CPU or GPU has "
                                               "native bf16")
    compile: bool = Field(False, description="torch.compile each client's model for local training (inductor); "
                          "falls back to eager with a warning where compiling fails")
    client_states: Literal["auto", "memory", "disk"] = Field(
        "auto", description="where per-client states (Local's, Ditto's, FedPer's models...) live: memory, disk "
        "(one file per client, read when trained or evaluated; for thousands of clients), or auto (disk when "
        "they would take more than half of the available memory)")
    channels_last: bool = Field(True, description="channels_last memory format for conv models")
    data_dir: str | None = Field(None, description="folder holding NAME/NAME.npz.xz (pfedkit data fetch); "
                                 "None: $PFEDKIT_DATA")
    data: DataConfig = Field(default_factory=DataConfig, description="options of hf: datasets")
    preset: str | None = Field(None, description="a shipped set of defaults (pfedkit list); the file and "
                               "overrides win over it")
    out_dir: str = Field("runs", description="where run directories are made")
    name: str | None = Field(None, description="run directory name (default: algorithm-dataset-timestamp)")
    checkpoint_every: int = Field(1, ge=1, description="write the resume checkpoint every this many rounds")

    @field_validator("client_model_options", mode="before")
    @classmethod
    def _range_keys_as_text(cls, value: Any) -> Any:
        # YAML reads a single-client key such as 5 as an int; ranges are always text.
        return {str(key): options for key, options in value.items()} if isinstance(value, dict) else value

    @model_validator(mode="after")
    def _check_algorithm_sections(self) -> "Config":
        names = list(catalog().algorithms)
        if self.algorithm not in names:
            raise ValueError(f"algorithm: {unknown_algorithm(self.algorithm)}")
        for key in self.model_extra or {}:
            if key not in names:
                allowed = ", ".join(sorted(Config.model_fields))
                hint = did_you_mean(key, list(Config.model_fields) + names)
                raise ValueError(f"{key}: unknown key{hint}; allowed keys: {allowed}, or an algorithm section")
        if self.new_clients >= self.num_clients:
            raise ValueError(f"new_clients: {self.new_clients} new clients leave none of the {self.num_clients} "
                             f"clients to train; allowed: 0..{self.num_clients - 1}")
        return self

    def hyper(self, algorithm: str | None = None) -> BaseModel:
        """The validated hyperparameters of `algorithm` (default: the run's algorithm)."""
        from pfedkit.algorithms import get_algorithm

        name = algorithm or self.algorithm
        section = (self.model_extra or {}).get(name) or {}
        if not isinstance(section, dict):
            raise ConfigError(f"{name}: expected a mapping of hyperparameters, got {section!r}")
        try:
            hyper_cls = get_algorithm(name).Hyper
            return hyper_cls(**section)
        except ValidationError as err:
            raise ConfigError(_format_validation_error(err, prefix=name, allowed=list(hyper_cls.model_fields))) from None

    def to_dict(self) -> dict[str, Any]:
        data = self.model_dump(mode="json")
        if self.dp.level == "none":
            del data["dp"]  # off: config.yaml and the run identity stay as before differential privacy existed
        for name in self.model_extra or {}:
            data[name] = self.hyper(name).model_dump(mode="json")
        if self.algorithm not in data:
            data[self.algorithm] = self.hyper().model_dump(mode="json")
        return data


def config_keys(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, description) of every key of `model`, its sections expanded
    (`partition.alpha`), choices of a Literal first in the description: what `pfedkit config`
    prints, read from the fields themselves so that a new key is listed with no other change."""
    rows = []
    for name, field in model.model_fields.items():
        key = prefix + name
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            rows += config_keys(field.annotation, key + ".")
            continue
        choices = [str(choice) for choice in _literal_choices(field.annotation)]
        description = "; ".join(text for text in (f"one of {', '.join(choices)}" if choices else "",
                                                  field.description or "") if text)
        rows.append((key, str(field.get_default(call_default_factory=True)), description))
    return rows


def _literal_choices(annotation: Any) -> list[Any]:
    """The values of a Literal annotation, also inside `Literal[...] | None`; [] otherwise."""
    if get_origin(annotation) is Literal:
        return list(get_args(annotation))
    return [choice for member in get_args(annotation) if get_origin(member) is Literal for choice in get_args(member)]


def split_config_and_overrides(items: list[str]) -> tuple[str | None, list[str]]:
    """A command line's `[CONFIG.yaml] [key=value ...]`: the first item is a config file unless it
    looks like key=value -> (config file or None, overrides)."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`a.b=1` strings -> nested dict; values parsed as YAML scalars (1 -> int, true -> bool)."""
    tree: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value (e.g. lr=0.01 or fedprox.mu=0.1)")
        key, raw = item.split("=", 1)
        value = parse_override_value(key, raw)
        node = tree
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        node[parts[-1]] = value
    return tree


def parse_override_value(key: str, raw: str) -> Any:
    """The value of `key=raw` read as YAML (1 -> int, true -> bool, [1, 2] -> list, {...} -> dict);
    ConfigError naming the key, the text and where the YAML broke."""
    if raw == "":
        return None
    try:
        return parse_yaml(raw)
    except yaml.YAMLError as err:
        shown = raw if len(raw) <= 80 else f"{raw[:60]}... ({len(raw):,} characters)"
        raise ConfigError(f"{key.strip()}={shown}: the value is not valid YAML ({yaml_problem(err)}); "
                          "quote it in the shell as a whole, e.g. 'lr=0.01' or "
                          "'client_model_options={\"0-6\": {\"c2\": 18}}'") from None


def parse_yaml(text: str) -> Any:
    """yaml.safe_load, failing only with YAMLError: PyYAML's parser recurses once per nesting
    level, so a document nested some thousand levels deep raises RecursionError, reported here as
    a YAMLError like any other unreadable document."""
    try:
        return yaml.safe_load(text)
    except RecursionError:
        raise yaml.YAMLError("nested deeper than the YAML reader can follow (about 1,000 levels); "
                             "flatten it") from None


def read_yaml_file(path: Path, what: str) -> Any:
    """The YAML document in the file at `path`; `what` names it in the one-line ConfigError for a
    file that cannot be read, is not UTF-8 text, or is not YAML."""
    try:
        return parse_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(f"{what}: not valid YAML ({yaml_problem(err)})") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{what}: not UTF-8 text (byte {err.start}: {err.reason}); expected a YAML file") from None
    except OSError as err:
        raise ConfigError(f"{what} cannot be read ({err.strerror or err})") from None


def yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error as one line: what broke, and where (line and column)."""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    mark = getattr(err, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + " ".join(str(problem).split())


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(source: str | Path | dict[str, Any] | None = None,
                overrides: list[str] | dict[str, Any] | None = None, *,
                expected_sections: Collection[str] = ()) -> Config:
    """Build a validated Config from a YAML path or dict, plus overrides. Raises ConfigError.

    What the Config holds is what is in effect: `model: auto` becomes the dataset's model, and
    the sections of algorithms other than the run's are dropped, with a ConfigWarning for those
    the file or overrides gave (not for `expected_sections`: `compare` passes its algorithms)."""
    data = _read_source(source)
    extra = parse_overrides(overrides) if isinstance(overrides, list) else (overrides or {})
    check_keys_and_text(extra, "overrides" if isinstance(overrides, list) else "config")
    data = deep_merge(data, extra)
    given = dict(data)
    if data.get("preset") is not None:  # the preset is the base; the file and overrides win over it
        data = deep_merge(read_preset(data["preset"]), data)
    try:
        config = Config(**data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None
    # What the catalog can check comes first: a misspelt name is refused without importing torch.
    check_option_names(config)
    check_against_dataset(config)
    per_client_model_options(config)
    config.hyper()  # validate the algorithm section now, not mid-run (imports the algorithms)
    for name in config.model_extra or {}:
        config.hyper(name)  # an inactive section too: a typo there is still a typo
    drop_inactive_sections(config, given, expected_sections)
    check_finite(config)
    resolve_model(config)
    return config


def unknown_algorithm(name: str) -> str:
    """`unknown algorithm 'x' (did you mean y?); allowed: ...` (from the catalog)."""
    names = list(catalog().algorithms)
    return f"unknown algorithm {name!r}{did_you_mean(name, names)}; allowed: {', '.join(names)}"


def check_option_names(config: Config) -> None:
    """The keys of every algorithm section are options of that algorithm (from the catalog: the
    values are validated by the algorithm's Hyper later)."""
    for name, section in (config.model_extra or {}).items():
        entry = catalog().algorithms[name]
        allowed = list(entry.options)
        unknown = [key for key in section if key not in allowed] if isinstance(section, dict) else []
        if unknown and unknown[0] in entry.removed:
            raise ConfigError(f"{name}.{unknown[0]}: {entry.removed[unknown[0]]}")
        if unknown:
            raise ConfigError(unknown_key_message(f"{name}.{unknown[0]}", unknown[0], allowed))


def unknown_key_message(where: str, key: Any, allowed: list[str]) -> str:
    """`where: unknown key (did you mean X?); allowed: ...`."""
    return f"{where}: unknown key{did_you_mean(key, allowed)}; allowed: {', '.join(allowed) or 'none'}"


def drop_inactive_sections(config: Config, given: dict[str, Any], expected: Collection[str] = ()) -> None:
    """Removes from `config` the sections of algorithms that are not running (they would change
    nothing, yet config.yaml would record them); warns about the ones in `given` (the user's
    file and overrides), unless `expected`."""
    extra = config.model_extra or {}  # the dict pydantic keeps the sections in (validated already)
    inactive = [key for key in extra if key != config.algorithm]
    running = config.algorithm
    unused = [key for key in inactive if key in given and key not in expected]
    if unused:
        options = [f"{name}.{key}={value}" for name in unused
                   for key, value in (given[name].items() if isinstance(given[name], dict) else [])] or unused
        warnings.warn(f"{', '.join(options)}: no effect, {' and '.join(unused)} not running (running: "
                      f"{', '.join(expected) or running}); left out of the run's config.yaml",
                      ConfigWarning, stacklevel=3)
    for key in inactive:
        del extra[key]


def resolve_model(config: Config) -> None:
    """`model: auto` -> the dataset's default model, so config.yaml names the model that ran."""
    from pfedkit.data.datasets import default_model

    if config.model == "auto":
        config.model = default_model(config.dataset)


def parse_client_range(key: str, num_clients: int) -> range:
    """`"0-6"` -> clients 0..6, `"5"` -> client 5; ConfigError if malformed or out of range."""
    where = f"client_model_options.{key}"
    parts = str(key).strip().split("-")
    if len(parts) not in (1, 2) or not all(part.strip().isdigit() for part in parts):
        raise ConfigError(f"{where}: expected a client id or a range like 0-6")
    first, last = int(parts[0]), int(parts[-1])
    if first > last:
        raise ConfigError(f"{where}: range starts after it ends; expected first-last with first <= last")
    if last >= num_clients:
        raise ConfigError(f"{where}: client {last} does not exist; allowed: 0..{num_clients - 1}")
    return range(first, last + 1)


def per_client_model_options(config: Config) -> list[dict[str, Any]] | None:
    """Each client's model options (`model_options` with its `client_model_options` range merged
    over), or None when all clients share `model_options`. Raises ConfigError for bad ranges,
    overlaps, or an algorithm that averages parameters."""
    if not config.client_model_options:
        return None
    algorithms = catalog().algorithms
    if not algorithms[config.algorithm].heterogeneous_models:
        allowed = [name for name, entry in algorithms.items() if entry.heterogeneous_models]
        raise ConfigError(f"client_model_options: algorithm {config.algorithm} averages model parameters and "
                          f"needs one architecture; allowed with: {', '.join(allowed)}")
    options: list[dict[str, Any]] = [dict(config.model_options) for _ in range(config.num_clients)]
    owner: dict[int, str] = {}
    for key, extra in config.client_model_options.items():
        for cid in parse_client_range(key, config.num_clients):
            if cid in owner:
                raise ConfigError(f"client_model_options.{key}: overlaps {owner[cid]} at client {cid}; "
                                  "ranges must not overlap")
            owner[cid] = key
            options[cid].update(extra)
    return options


def preset_names() -> list[str]:
    """The presets shipped in pfedkit/presets/ (one YAML file each)."""
    return sorted(p.name.removesuffix(".yaml") for p in resources.files("pfedkit.presets").iterdir()
                  if p.name.endswith(".yaml"))


def read_preset(name: Any) -> dict[str, Any]:
    """The config values of preset `name`, without its own `preset` key. ConfigError if unknown."""
    if name not in preset_names():
        raise ConfigError(f"preset: unknown preset {name!r}{did_you_mean(name, preset_names())}; "
                          f"allowed: {', '.join(preset_names())}")
    data = yaml.safe_load(resources.files("pfedkit.presets").joinpath(f"{name}.yaml").read_text()) or {}
    data.pop("preset", None)
    return data


def preset_summary(name: str) -> str:
    """The first comment line of a preset file (what `pfedkit list` shows)."""
    text = resources.files("pfedkit.presets").joinpath(f"{name}.yaml").read_text()
    first = next((line for line in text.splitlines() if line.startswith("#")), "#")
    return first.lstrip("# ").strip()


def _read_source(source: str | Path | dict[str, Any] | None) -> dict[str, Any]:
    if source is None:
        return {}
    if isinstance(source, dict):
        check_keys_and_text(source, "config")
        return dict(source)
    path = Path(source)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise ConfigError(f"config file {path.absolute()} {what}; expected a YAML file (or key=value overrides)")
    data = read_yaml_file(path, f"config file {path}") or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of keys at the top level")
    check_keys_and_text(data, f"config file {path}")
    return data


def check_keys_and_text(data: dict[str, Any], where: str) -> None:
    """ConfigError (one line, starting with `where`) for a key that is not a name (YAML reads
    `1: 2` as the number 1; only client_model_options' keys may be client numbers) and for text
    holding a lone surrogate (YAML's "\\ud800"), which no file name or file can hold."""
    pending: list[tuple[str, Any]] = [("", data)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, str):
            _check_text(value, path, where)
        elif isinstance(value, (list, tuple)):
            pending += [(f"{path}[{index}]", item) for index, item in enumerate(value)]
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str):
                    _check_text(key, f"{path}{key}", where)
                elif path != "client_model_options.":
                    raise ConfigError(f"{where}: key {path}{key!r} is not a name (YAML read it as "
                                      f"{type(key).__name__}); keys are names such as rounds or lr (pfedkit config "
                                      "lists them)")
                pending.append((f"{path}{key}.", item))


def _check_text(text: str, path: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{where}: {path.rstrip('.') or 'a key'}: {text!r} holds a lone surrogate, which is not "
                          "text any file or folder name can hold; write it with ordinary characters") from None


# The largest float32: training computes in float32 (bf16 autocast has the same range), so a
# setting beyond it cannot even be handed to the optimiser (lr=1e308: torch's "value cannot be
# converted to type float without overflow"). Values within it that still blow the weights up
# end as TrainingDiverged (exit 3).
FLOAT32_MAX = 3.4028234663852886e38


def check_finite(config: Config) -> None:
    """Refuse NaN, infinite numbers and numbers beyond float32's range anywhere in the config
    (lr=inf, fedprox.mu=.nan, lr=1e308): YAML and pydantic accept them, and a run would train to
    NaN without a word, or stop in the optimiser with a traceback."""
    import math

    values = {**config.model_dump(), **{name: config.hyper(name).model_dump() for name in config.model_extra or {}}}
    pending = [(key, value) for key, value in values.items()]
    while pending:
        key, value = pending.pop()
        if isinstance(value, dict):
            pending += [(f"{key}.{inner}", item) for inner, item in value.items()]
        elif isinstance(value, (list, tuple)):
            pending += [(f"{key}[{index}]", item) for index, item in enumerate(value)]
        elif isinstance(value, float) and not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
            field = Config.model_fields.get(key)
            default = f" (default {field.default})" if field is not None and isinstance(field.default, float) else ""
            if math.isfinite(value):
                raise ConfigError(f"{key}: {value:g} is beyond float32's range (±{FLOAT32_MAX:.2g}), the precision "
                                  f"training computes in; give a value within it{default}")
            raise ConfigError(f"{key}: {value} is not a finite number; give a finite value{default}")


def check_against_dataset(config: Config) -> None:
    """Checks that need the dataset's size and class count (read from metadata, no loading)."""
    from pfedkit.data.datasets import DATASETS

    if config.dataset.startswith("hf:"):  # size and classes are known once converted: checked when loaded
        if not config.dataset[3:].strip():
            raise ConfigError("dataset: hf: needs a Hub dataset name or a save_to_disk folder, e.g. hf:ylecun/mnist")
        check_model_reads_dataset(config, "image")
        return
    if config.dataset not in DATASETS:
        raise ConfigError(f"dataset: unknown dataset {config.dataset!r}{did_you_mean(config.dataset, DATASETS)}; "
                          f"allowed: {', '.join(DATASETS)}")
    info = DATASETS[config.dataset]
    check_model_reads_dataset(config, info.kind)
    part = config.partition
    if part.scheme == "pathological" and part.classes_per_client > info.num_classes:
        raise ConfigError(f"partition.classes_per_client: {part.classes_per_client} is more than the "
                          f"{info.num_classes} classes of {config.dataset}; allowed: 1..{info.num_classes}")
    if part.scheme == "nway_kshot" and part.n > info.num_classes - 1:
        raise ConfigError(f"partition.n: {part.n} ways needs at most {info.num_classes - 1} "
                          f"for {config.dataset}; allowed: 2..{info.num_classes - 1}")
    if config.num_clients > info.num_samples:
        raise ConfigError(f"num_clients: {config.num_clients} clients but {config.dataset} has only "
                          f"{info.num_samples} samples; allowed: 1..{info.num_samples}")


def check_model_reads_dataset(config: Config, kind: str) -> None:
    """`model` is a known model that reads what the dataset holds (`kind`: image, features or text):
    token ids for a model of token ids (fastText), images or feature vectors for the others."""
    from pfedkit.data.datasets import DATASETS, default_model

    models = catalog().models
    if config.model == "auto":
        return
    if config.model not in models:
        raise ConfigError(f"model: unknown model {config.model!r}{did_you_mean(config.model, models)}; "
                          f"allowed: auto, {', '.join(models)}")
    if models[config.model].token_ids != (kind == "text"):
        holds = {"image": "images", "features": "feature vectors", "text": "token ids"}[kind]
        if kind == "text":
            fit = [name for name, entry in models.items() if entry.token_ids]
        else:
            fit = [name for name, info in DATASETS.items() if info.kind == "text"]
        wants = "a text dataset" if kind != "text" else "a model of token ids"
        raise ConfigError(f"model: {config.model} cannot read {config.dataset}, which holds {holds}; use it with "
                          f"{wants} ({', '.join(fit)}), or model=auto ({default_model(config.dataset)} for "
                          f"{config.dataset})")


def _section_keys(loc: tuple) -> list[str]:
    """The keys allowed beside the last part of `loc` in the nested section it names
    (`("partition", "alpah")` -> PartitionConfig's fields)."""
    model: Any = Config
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        model = field.annotation if field is not None else None
    return list(getattr(model, "model_fields", {}))


def _format_validation_error(err: ValidationError, prefix: str | None = None,
                             allowed: list[str] | None = None) -> str:
    messages = []
    for item in err.errors():
        loc = ".".join(str(p) for p in ((prefix,) if prefix else ()) + tuple(item["loc"]))
        msg = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            keys = allowed if prefix else _section_keys(tuple(item["loc"]))
            messages.append(unknown_key_message(loc, item["loc"][-1], keys))
        elif loc and not msg.startswith(loc.split(".")[-1] + ":"):
            messages.append(f"{loc}: {msg} (got {item.get('input')!r})")
        else:
            messages.append(msg)
    return "; ".join(messages)
