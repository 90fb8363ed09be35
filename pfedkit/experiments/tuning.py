"""`pfedkit tune`: every method tuned the same way (Optuna), on a validation split, never on test.

A tuning directory holds one folder per algorithm:
    DIR/<algorithm>/study.db      the Optuna study (SQLite): a killed `tune` resumes where it stopped
    DIR/<algorithm>/tuning.json   what is tuned (base config identity, search space, metric) and the best trial
    DIR/<algorithm>/trials.csv    one row per trial (params, value, state)
    DIR/<algorithm>/best.yaml     the best trial's parameters, as a partial config (what `compare --tuned` applies)
    DIR/<algorithm>/best_config.yaml  the base config with those parameters: `pfedkit run` runs it on test

Protocol (the same for every algorithm, so a table compares methods tuned with the same budget):
* Each trial is an ordinary simulation of the base config with the trial's parameters and
  `validation_fraction` > 0 (default 0.2): every client's training split loses that share to a
  validation split (pfedkit.data.validation), which is evaluated in place of the test split. The
  test rows are dropped before any data are gathered: no trial ever reads them.
* The objective is the config's headline (weighting and point: `headline.*`) on validation; the
  round's validation accuracy (same weighting) is reported to the trial at every evaluated round,
  and a median pruner stops trials below the median of earlier trials at the same round (not
  before 5 trials finished nor before a quarter of the rounds).
* Sampler: TPE. Its seed is derived from the config's seed and the number of finished trials, so
  trial k's parameters depend only on the seed and the finished trials before it: the same seed
  gives the same trials, and a study killed mid-trial (that trial is marked failed on resume and
  not counted) continues with the very trial it lost.
* `--trials N` means N finished (complete or pruned) trials in total, earlier runs included.
A trial whose training diverges is recorded as pruned (it is a finished, informative trial).

Search spaces: `lr` for every algorithm (COMMON_SPACE) plus the ranges each algorithm declares on
its own options (`pfedkit.core.search`), so a new method brings its space in its own file;
`--space FILE` replaces all of them (docs/tuning.md).
"""
from __future__ import annotations

import fcntl
import json
import math
import sys
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
import pandas as pd
import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from pfedkit.atomic import atomic_write_json, atomic_write_text
from pfedkit.config import Config, deep_merge, load_config, read_yaml_file
from pfedkit.core.errors import ConfigError, ConfigWarning
from pfedkit.core.search import declared_ranges
from pfedkit.run_identity import changed_keys, describe_changes, flatten, identity

COMMON = "common"
SHIPPED = "the shipped search spaces (COMMON_SPACE and the ranges declared on the algorithms' options)"
DEFAULT_VALIDATION_FRACTION = 0.2
STUDY_DB, STATE, TRIALS_CSV, BEST, BEST_CONFIG, LOCK = (
    "study.db", "tuning.json", "trials.csv", "best.yaml", "best_config.yaml", ".lock")
PRUNER_STARTUP_TRIALS = 5  # no pruning before this many trials finished: the median needs a few
# What every algorithm is tuned on; an algorithm's own options declare their ranges themselves
# (`pfedkit.core.search`, on the fields of its Hyper).
COMMON_SPACE: dict[str, dict[str, Any]] = {"lr": {"type": "float", "low": 0.003, "high": 0.3, "log": True}}


class ParamSpec(BaseModel):
    """One searched parameter: the format of a --space file's entries and of `pfedkit.core.search`'s
    ranges (docs/tuning.md, "Search spaces")."""
    model_config = ConfigDict(extra="forbid")

    type: Literal["float", "int", "categorical"]
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: list[Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> "ParamSpec":
        if self.type == "categorical":
            if not self.choices or self.low is not None or self.high is not None:
                raise ValueError("categorical needs a non-empty `choices` list and no low/high")
            return self
        if self.low is None or self.high is None or self.choices is not None:
            raise ValueError(f"{self.type} needs `low` and `high` (and no choices)")
        if not (math.isfinite(self.low) and math.isfinite(self.high)) or self.low >= self.high:
            raise ValueError(f"needs finite low < high (got low={self.low}, high={self.high})")
        if self.log and self.low <= 0:
            raise ValueError(f"log: true needs low > 0 (got {self.low})")
        if self.type == "int" and (self.low != int(self.low) or self.high != int(self.high)):
            raise ValueError(f"int needs integer low and high (got {self.low}, {self.high})")
        if self.step is not None and (self.step <= 0 or self.log):
            raise ValueError("step must be > 0 and cannot be combined with log: true")
        return self

    def suggest(self, trial, name: str) -> Any:
        if self.type == "categorical":
            return trial.suggest_categorical(name, self.choices)
        if self.type == "int":
            return trial.suggest_int(name, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(name, self.low, self.high, step=self.step, log=self.log)

    def ends(self) -> list[Any]:
        """The extreme values, used to check the parameter against the config before any trial."""
        if self.type == "categorical":
            return list(self.choices)
        cast = int if self.type == "int" else float
        return [cast(self.low), cast(self.high)]


Space = dict[str, ParamSpec]


def read_spaces(path: str | Path | None = None) -> dict[str, Space]:
    """The search spaces by section (`common` and algorithm names): the shipped ones
    (`shipped_spaces`), or the YAML file `path` instead of all of them. ConfigError (one line) for
    anything malformed."""
    if path is None:
        return shipped_spaces()
    if not Path(path).is_file():
        raise ConfigError(f"--space {path}: no such file; expected a YAML search-space file (docs/tuning.md, "
                          "'Search spaces')")
    where = f"--space {path}"
    return parse_spaces(read_yaml_file(Path(path), where) or {}, where)


def shipped_spaces() -> dict[str, Space]:
    """The shipped search spaces: `common` (COMMON_SPACE) and, for each algorithm, the ranges
    declared on its options (`pfedkit.core.search`). An algorithm without options gets an empty
    section (nothing of its own to tune); one whose options declare no range gets none, so
    `space_for` says that only the common parameters are tuned."""
    from pfedkit.algorithms import algorithm_names, get_algorithm

    data: dict[str, Any] = {COMMON: COMMON_SPACE}
    for name in algorithm_names():
        hyper = get_algorithm(name).Hyper
        ranges = declared_ranges(hyper)
        if ranges or not hyper.model_fields:
            data[name] = {f"{name}.{option}": spec for option, spec in ranges.items()}
    return parse_spaces(data, SHIPPED)


def parse_spaces(data: Any, where: str) -> dict[str, Space]:
    """Sections of parameter specs (`common`, algorithm names) checked and parsed; ConfigError
    (one line, starting with `where`) for anything malformed."""
    from pfedkit.algorithms import algorithm_names

    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of sections ({COMMON}, or an algorithm name) at the top level")
    names = algorithm_names()
    spaces: dict[str, Space] = {}
    for section, params in data.items():
        if section != COMMON and section not in names:
            from pfedkit.core.errors import did_you_mean
            raise ConfigError(f"{where}: unknown section {section!r}{did_you_mean(section, names)}; "
                              f"allowed: {COMMON} or an algorithm name (pfedkit list)")
        if not isinstance(params, dict):
            raise ConfigError(f"{where}: section {section} must map config keys to parameter specs, got {params!r}")
        spaces[section] = {}
        for key, spec in params.items():
            head = str(key).split(".")[0]
            if head in names and head != section:
                raise ConfigError(f"{where}: {section}.{key}: a {head} option in the {section} section; "
                                  f"put it under {head}:")
            if not isinstance(spec, dict):
                raise ConfigError(f"{where}: {section}.{key}: expected a mapping like "
                                  "{type: float, low: 0.001, high: 0.1, log: true}")
            try:
                spaces[section][str(key)] = ParamSpec(**spec)
            except ValidationError as err:
                problem = "; ".join(e["msg"].removeprefix("Value error, ") for e in err.errors())
                raise ConfigError(f"{where}: {section}.{key}: {problem}") from None
    return spaces


def space_for(spaces: dict[str, Space], algorithm: str) -> tuple[Space, str | None]:
    """The parameters searched for `algorithm` (common + its section) and a note when the spaces
    have no section for it (then only the common parameters are tuned)."""
    space = dict(spaces.get(COMMON, {}))
    note = None
    if algorithm in spaces:
        space.update(spaces[algorithm])
    else:
        note = (f"no search space for {algorithm}: tuning {', '.join(space) or 'nothing'} only "
                f"(add a {algorithm} section to a --space file to tune its own options)")
    if not space:
        raise ConfigError(f"the search space for {algorithm} is empty; give parameters under {COMMON} or {algorithm}")
    return space, note


def nested(params: dict[str, Any]) -> dict[str, Any]:
    """{"fedprox.mu": 0.1, "lr": 0.01} -> {"fedprox": {"mu": 0.1}, "lr": 0.01} (a partial config)."""
    tree: dict[str, Any] = {}
    for key, value in params.items():
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return tree


def trial_config(base: Config, params: dict[str, Any], **changes: Any) -> Config:
    """`base` with `params` (dotted keys) and `changes` (top-level keys) applied, validated."""
    data = deep_merge(base.to_dict(), nested(params))
    data.update(changes)
    return load_config(data)


def check_space(base: Config, space: Space, where: str) -> None:
    """Every parameter is a config key whose extreme values the config accepts (before any trial)."""
    for key, spec in space.items():
        for value in spec.ends():
            try:
                config = trial_config(base, {key: value})
            except ConfigError as err:
                raise ConfigError(f"{where}: {key}={value}: {err}") from None
            if flatten(config.to_dict()).get(key, object()) != value:
                raise ConfigError(f"{where}: {key} is not a config key of a {base.algorithm} run "
                                  "(pfedkit list ALGORITHM shows its options)")


# ---- one trial ---------------------------------------------------------------------------------

def round_accuracy(rows: list[dict], weighting: str) -> float | None:
    """The round's validation accuracy over the training clients (new clients left out):
    sample-weighted (correct / n) or the unweighted mean of the clients' accuracies."""
    evaluated = [row for row in rows if row.get("accuracy") is not None
                 and not (isinstance(row["accuracy"], float) and math.isnan(row["accuracy"]))
                 and not row.get("new_client")]
    if not evaluated:
        return None
    if weighting == "unweighted":
        return float(np.mean([row["accuracy"] for row in evaluated]))
    return float(sum(row["correct"] for row in evaluated) / max(1, sum(row["n_test"] for row in evaluated)))


def run_trial(config: Config, report: Callable[[int, float], None]) -> tuple[float, pd.DataFrame]:
    """One simulation of `config` (a validation config: its 'test' is the validation split), in
    memory (no run directory). `report(round, accuracy)` after each evaluated round may raise
    optuna.TrialPruned. Returns the headline on validation and the per-(round, client) metrics."""
    from pfedkit.evaluation import summarize
    from pfedkit.runs import prepare

    if not config.validation_fraction:
        raise ValueError("a tuning trial must evaluate on a validation split (validation_fraction > 0)")
    context = prepare(config)
    sim, state = context.simulation, context.state
    try:
        while state.round < config.rounds:
            start = len(state.rows)
            sim.run_round(state)
            accuracy = round_accuracy(state.rows[start:], config.headline.weighting)
            if accuracy is not None:
                report(state.round, accuracy)
    finally:
        context.runtime.close()
    metrics = pd.DataFrame(state.rows)
    summary = summarize(metrics, algorithm=config.algorithm, dataset=config.dataset, rounds=config.rounds,
                        class_correct=None, class_total=None, train_counts=context.data.train_counts(),
                        weighting=config.headline.weighting, point=config.headline.point,
                        eval_point=config.eval_point)
    return float(summary["headline_acc"]), metrics


# ---- the study ---------------------------------------------------------------------------------

def sampler_seed(seed: int, finished: int) -> int:
    """The TPE seed of the trial that starts after `finished` finished trials."""
    entropy = np.random.SeedSequence([int(seed), int(finished), zlib.crc32(b"tune")])
    return int(entropy.generate_state(1)[0])


@dataclass
class TuneResult:
    directory: Path
    best_params: dict[str, Any]
    best_value: float
    best_trial: int
    finished: int
    new_trials: int


@contextmanager
def exclusive(directory: Path):
    """One `tune` per study at a time: then every RUNNING trial in it is one a killed run left."""
    with open(directory / LOCK, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"{directory}: another pfedkit tune is running on this study; wait for it "
                              "or use another --out") from None
        yield


def tuning_record(base: Config, space: Space) -> dict[str, Any]:
    """What a study tunes: the trial configs' shared identity (seed included) and the space."""
    return {"algorithm": base.algorithm, "base": identity(base),
            "space": {key: spec.model_dump(exclude_none=True) for key, spec in space.items()},
            "objective": f"validation headline: {base.headline.weighting}, {base.headline.point}"}


def check_same_study(directory: Path, record: dict[str, Any]) -> None:
    state_file = directory / STATE
    if not state_file.is_file():
        return
    stored = json.loads(state_file.read_text())
    changes = {**changed_keys(stored.get("base", {}), record["base"]),
               **changed_keys({"space": stored.get("space", {})}, {"space": record["space"]})}
    if changes:
        raise ConfigError(f"{directory}: this study was tuned with other settings ({describe_changes(changes)}); "
                          "use another --out to start a new study, or restore those settings to resume it")


def tune(config: Config, trials: int, out_dir: str | Path, space_file: str | Path | None = None, *,
         log: Callable[[str], None] = lambda text: print(text, file=sys.stderr)) -> TuneResult:
    """Run (or resume) the study of `config.algorithm` until `trials` trials have finished."""
    import optuna

    if trials < 1:
        raise ConfigError(f"--trials {trials}: expected a number of trials >= 1")
    base, space = tuning_base(config, space_file, log)
    directory = Path(out_dir) / base.algorithm
    directory.mkdir(parents=True, exist_ok=True)
    record = tuning_record(base, space)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with exclusive(directory):
        check_same_study(directory, record)
        atomic_write_json(directory / STATE, {**_stored_state(directory), **record})
        study = open_study(directory, base, log)
        finished, new_trials = finished_trials(study), 0
        if finished:
            log(f"resuming {directory}: {finished} finished trial(s)")
        while finished < trials:
            started = time.perf_counter()
            trial, params, outcome = run_next_trial(study, base, space, finished)
            finished += 1
            new_trials += 1
            best = _best(study)
            best_text = f"best {100 * best.value:.2f}% (trial {best.number})" if best else "no completed trial yet"
            log(f"[trial {finished}/{trials}] #{trial.number} {_show(params)}: {outcome}; {best_text} "
                f"[{time.perf_counter() - started:.1f}s]")
        best = _best(study)
        write_trials(directory, study)
        if best is None:
            raise ConfigError(f"{directory}: no trial completed ({finished} pruned or diverged); "
                              "narrow the search space (e.g. a lower lr range) or add trials")
        write_best(directory, config, base, best, finished)
    return TuneResult(directory, dict(best.params), float(best.value), best.number, finished, new_trials)


def tuning_base(config: Config, space_file: str | Path | None, log: Callable[[str], None]) -> tuple[Config, Space]:
    """(the trials' base config: `config` on a validation split, the algorithm's search space),
    the space checked against the base config; a note on the space (e.g. only the common part
    applies) goes to `log`."""
    where = f"--space {space_file}" if space_file is not None else SHIPPED
    space, note = space_for(read_spaces(space_file), config.algorithm)
    fraction = config.validation_fraction or DEFAULT_VALIDATION_FRACTION
    base = trial_config(config, {}, validation_fraction=fraction)
    check_space(base, space, where)
    if note:
        log(f"note: {note}")
    return base, space


def open_study(directory: Path, base: Config, log: Callable[[str], None]):
    """The study in DIR/study.db (created or loaded: TPE, maximise, median pruner); trials a killed
    run left RUNNING are marked failed (the caller holds the study's lock, so none is running)."""
    import optuna
    from optuna.trial import TrialState

    storage = optuna.storages.RDBStorage(f"sqlite:///{(directory / STUDY_DB).resolve()}")
    pruner = optuna.pruners.MedianPruner(n_startup_trials=PRUNER_STARTUP_TRIALS, n_warmup_steps=base.rounds // 4)
    study = optuna.create_study(storage=storage, study_name=base.algorithm, direction="maximize",
                                pruner=pruner, load_if_exists=True)
    for stale in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study.tell(stale.number, state=TrialState.FAIL)  # its process was killed (we hold the lock)
        log(f"trial {stale.number}: left unfinished by a stopped run; marked failed, not counted")
    return study


def finished_trials(study) -> int:
    """Trials that count towards --trials: complete or pruned (diverged ones are recorded as pruned)."""
    from optuna.trial import TrialState

    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))


def run_next_trial(study, base: Config, space: Space, finished: int) -> tuple[Any, dict[str, Any], str]:
    """Ask the study for the trial that follows `finished` finished trials (TPE seeded by
    `sampler_seed`, so it depends only on the seed and those trials), run it, and tell the study
    how it ended: complete, pruned by the median pruner, or diverged (recorded as pruned); any other
    error marks it failed and is raised. -> (trial, its parameters, the outcome in words)."""
    import optuna
    from optuna.trial import TrialState

    from pfedkit.engine.drive import TrainingDiverged

    study.sampler = optuna.samplers.TPESampler(seed=sampler_seed(base.seed, finished))
    trial = study.ask()
    params = {key: spec.suggest(trial, key) for key, spec in space.items()}
    reported = []

    def report(rnd: int, accuracy: float) -> None:
        trial.report(accuracy, rnd)
        reported.append(rnd)
        if trial.should_prune():
            raise optuna.TrialPruned()

    try:
        value, _ = run_trial(trial_config(base, params), report)
    except optuna.TrialPruned:
        study.tell(trial, state=TrialState.PRUNED)
        return trial, params, f"pruned at round {reported[-1]}"
    except TrainingDiverged as err:
        trial.set_user_attr("diverged", str(err))
        study.tell(trial, state=TrialState.PRUNED)
        return trial, params, f"diverged in round {err.round} (recorded as pruned)"
    except BaseException:
        study.tell(trial, state=TrialState.FAIL)
        raise
    study.tell(trial, value)
    return trial, params, f"validation {100 * value:.2f}%"


def _stored_state(directory: Path) -> dict[str, Any]:
    state_file = directory / STATE
    return json.loads(state_file.read_text()) if state_file.is_file() else {}


def _best(study):
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return max(complete, key=lambda t: (t.value, -t.number)) if complete else None  # ties: the earliest


def _show(params: dict[str, Any]) -> str:
    return " ".join(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
                    for key, value in params.items())


def write_trials(directory: Path, study) -> None:
    rows = [{"number": t.number, "state": t.state.name, "value": t.value,
             "rounds_reported": len(t.intermediate_values),
             **{f"params_{k}": v for k, v in t.params.items()}} for t in study.get_trials(deepcopy=False)]
    atomic_write_text(directory / TRIALS_CSV, pd.DataFrame(rows).to_csv(index=False))


def write_best(directory: Path, config: Config, base: Config, best, finished: int) -> None:
    """best.yaml (the parameters), best_config.yaml (a runnable config, on test) and tuning.json."""
    params = dict(best.params)
    header = (f"# pfedkit tune: best of {finished} finished trials: trial {best.number}, validation "
              f"{100 * best.value:.2f}% ({base.headline.weighting}, {base.headline.point}; validation_fraction "
              f"{base.validation_fraction}).\n# `pfedkit compare --tuned {directory.parent}` applies these "
              f"parameters; best_config.yaml is the whole config.\n")
    atomic_write_text(directory / BEST, header + yaml.safe_dump({"algorithm": base.algorithm, **nested(params)},
                                                                sort_keys=False))
    final = trial_config(config, params, validation_fraction=0.0)
    atomic_write_text(directory / BEST_CONFIG, header + yaml.safe_dump(final.to_dict(), sort_keys=False))
    state = _stored_state(directory)
    state.update({"best": {"trial": best.number, "value": best.value, "params": params},
                  "finished_trials": finished})
    atomic_write_json(directory / STATE, state)


# ---- compare --tuned ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Tuned:
    """An algorithm's tuned parameters (from DIR/<algorithm>/best.yaml) and its study's budget."""
    algorithm: str
    params: dict[str, Any]  # dotted keys
    trials: int | None
    base: dict[str, Any]  # identity of the trials' config


def read_tuned(tuned_dir: str | Path, algorithm: str) -> Tuned | None:
    """The tuned parameters of `algorithm` in a tuning directory, or None when it has no best.yaml."""
    directory = Path(tuned_dir) / algorithm
    best_file = directory / BEST
    if not best_file.is_file():
        return None
    data = read_yaml_file(best_file, str(best_file)) or {}
    if not isinstance(data, dict) or data.get("algorithm", algorithm) != algorithm:
        raise ConfigError(f"{best_file}: expected the tuned parameters of {algorithm} (written by pfedkit tune)")
    data.pop("algorithm", None)
    state = _stored_state(directory)
    return Tuned(algorithm, flatten(data), state.get("finished_trials"), state.get("base", {}))


def tuned_config(source, overrides: list[str], algorithm: str, tuned: Tuned, **load_options) -> Config:
    """The compare entry of a tuned algorithm: the config file, then the tuned parameters, then the
    command line's overrides (explicit wins; a ConfigWarning names any tuned value it replaces)."""
    import warnings

    from pfedkit.config import parse_overrides

    given = flatten(parse_overrides(overrides))
    replaced = [key for key in tuned.params if key in given]
    if replaced:
        warnings.warn(f"{algorithm}: {', '.join(f'{key}={given[key]}' for key in replaced)} from the command line "
                      f"replace(s) the tuned value(s) {', '.join(f'{k}={tuned.params[k]}' for k in replaced)}",
                      ConfigWarning, stacklevel=2)
    tree = deep_merge(nested(tuned.params), parse_overrides(overrides))
    tree["algorithm"] = algorithm
    return load_config(source, tree, **load_options)


def tuned_setting_changes(tuned: Tuned, config: Config) -> str:
    """The settings (other than the tuned ones, the seed and the validation split) in which the
    compared config differs from the trials' config, described in one line ("" if none)."""
    if not tuned.base:
        return ""
    skip = set(tuned.params) | {"seed", "validation_fraction"}
    before = {k: v for k, v in flatten(tuned.base).items() if k not in skip}
    after = {k: v for k, v in flatten(identity(config)).items() if k not in skip}
    return describe_changes(changed_keys(before, after))
