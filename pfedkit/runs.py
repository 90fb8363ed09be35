"""`pfedkit.run(config) -> Result`: a whole run, recorded in its run directory.

Run directory (one per run under `out_dir`):
    config.yaml      resolved configuration
    partition.npz    per-client train/test row indices (train_<cid>, test_<cid>)
    metrics.csv      one row per (round, client)
    summary.json     headline numbers (see pfedkit.evaluation.summarize), strict JSON (NaN -> null)
    checkpoints/latest.pt   everything needed to resume (server, clients, metrics so far)
    checkpoints/config.json what the run computes (run_identity.identity); resume refuses an edit of it
    client_states/   with client_states=disk: one file per client state (the checkpoint names them)
    diagnostics.pt   what the algorithm recorded (Algorithm.record), for `pfedkit report`
    clients.npz      per client x class tables, for `pfedkit report`
Every file is written atomically; `run(resume=DIR)` continues a killed run and ends with metrics
identical to an uninterrupted run, because all randomness is derived from (seed, round, client,
purpose) and the checkpoint holds the whole simulation state.

Every file read back is data, never unpickled (pfedkit/run_files.py): a run directory may come
from anyone. Resume checks what it reads before it changes anything: partition.npz, the
checkpoint (refused when another run wrote it: it holds that run's identity) and the client
state files it names; a missing, damaged or foreign file is one RunFileError line (exit 2) and
the directory is left as it was. Only then does it remove what a killed write left behind
(`.NAME.PID.tmp` files of atomic writes, client state files newer than the checkpoint).
The directory is claimed by `mkdir` (never shared, never reused); a run whose training loss
becomes non-finite stops (`TrainingDiverged`) keeping the metrics of its completed rounds.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from tqdm import tqdm

from pfedkit.atomic import atomic_savez, atomic_write_json, atomic_write_text, remove_stale_temporaries
from pfedkit.build import (build_algorithm, check_precision, make_runtime, model_name, run_threads, simulation_for,
                           uses_channels_last)
from pfedkit.config import Config, load_config
from pfedkit.core.errors import ConfigError
from pfedkit.data.federated import FederatedData, assemble, build_federated
from pfedkit.engine.client_states import STATES_DIR, DiskStates, Placement, disk_stores
from pfedkit.engine.drive import TrainingDiverged
from pfedkit.engine.simulate import Simulation
from pfedkit.engine.state import SimState, read_checkpoint, write_checkpoint
from pfedkit.evaluation import summarize
from pfedkit.federation import config_dataset, split_plan
from pfedkit.privacy.setup import check_a_round_fits, privacy_budget
from pfedkit.run_files import DIAGNOSTICS, RESUME_FIX, RunFileError, read_partition, write_data
from pfedkit.run_identity import changed_keys, describe_changes, identity

CHECKPOINT = "checkpoints/latest.pt"
RUN_IDENTITY = "checkpoints/config.json"  # what the run computes (see run_identity), written once at start


@dataclass
class Result:
    summary: dict[str, Any]
    metrics: pd.DataFrame
    run_dir: Path


def run(config: str | Path | dict | Config | None = None, overrides: list[str] | dict | None = None, *,
        resume: str | Path | None = None, quiet: bool = True) -> Result:
    """Run (or resume) one federated simulation; returns its summary and per-(round, client) metrics."""
    if resume is not None:
        run_dir = Path(resume)
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"--resume {run_dir}: no config.yaml there; expected a run directory")
        config = load_config(run_dir / "config.yaml")
        check_unchanged(run_dir, config)
        context = prepare(config, resume_dir=run_dir)
        for folder in (run_dir, run_dir / "checkpoints"):  # only now: a refused resume changes nothing
            remove_stale_temporaries(folder)
    else:
        if not isinstance(config, Config):
            config = load_config(config, overrides)
        # Claimed first: client states on disk are written into it as they are built; a refused
        # or failed setup leaves no run directory behind (nor an out_dir this run created).
        out_existed = Path(config.out_dir).is_dir()
        run_dir = claim_run_dir(config)
        try:
            context = prepare(config, state_dir=run_dir / STATES_DIR)
        except BaseException:
            discard_run_dir(run_dir, remove_out_dir=not out_existed)
            raise
        start_run_dir(config, context.data, run_dir)
    return execute(config, context, run_dir, quiet=quiet)


def start_run_dir(config: Config, data: FederatedData, run_dir: Path | None = None) -> Path:
    """The run directory, with checkpoints/, the run's config.yaml, its identity and partition.npz:
    a new one, or `run_dir` (from `claim_run_dir`; setup may have put client states in it)."""
    run_dir = run_dir or claim_run_dir(config)
    (run_dir / "checkpoints").mkdir()
    atomic_write_text(run_dir / "config.yaml", yaml.safe_dump(config.to_dict(), sort_keys=False))
    atomic_write_json(run_dir / RUN_IDENTITY, identity(config))
    atomic_savez(run_dir / "partition.npz", **data.partition_arrays())
    return run_dir


def check_unchanged(run_dir: Path, config: Config) -> None:
    """Refuse to resume a run whose config.yaml was edited in anything that changes its numbers
    (execution keys such as backend or workers may change: see run_identity). A run directory
    from before the identity was recorded is resumed unchecked."""
    stored_file = run_dir / RUN_IDENTITY
    if not stored_file.is_file():
        return
    try:
        stored = json.loads(stored_file.read_text())
    except (ValueError, OSError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise RunFileError(f"{stored_file}: not readable JSON ({err}); {RESUME_FIX}") from None
    if not isinstance(stored, dict):
        raise RunFileError(f"{stored_file}: not a run's identity (a {type(stored).__name__}, expected an "
                           f"object of config keys); {RESUME_FIX}")
    changes = changed_keys(stored, identity(config))
    if changes:
        raise ConfigError(f"--resume {run_dir}: config.yaml was edited after the run started "
                          f"({describe_changes(changes)}); a resumed run must continue with the settings it "
                          "started with: restore them, or start a new run with the new settings")


@dataclass
class Prepared:
    data: FederatedData
    simulation: Simulation
    state: SimState
    runtime: Any  # closed when the run ends (a Runtime; a Flower run's FlowerClients)
    resumable: bool = True  # False: no checkpoint (a Flower run: the client states are on the nodes)
    backend: str | None = None  # the summary's `backend` when not config.backend


def prepare(config: Config, resume_dir: Path | None = None, state_dir: Path | None = None) -> Prepared:
    """Load data, partition, build model, algorithm, runtime and the (initial or resumed) state.
    `state_dir`: where client states go when they are kept on disk (`client_states`); default:
    the resumed run's, or a scratch directory under `out_dir` deleted with the state."""
    check_precision(config)
    dataset = config_dataset(config)
    channels_last = uses_channels_last(config, dataset.input_shape)
    saved = None
    if resume_dir is not None:
        train_index, test_index = read_partition(resume_dir / "partition.npz", config.num_clients, len(dataset.y),
                                                 RESUME_FIX)
        data = assemble(dataset, train_index, test_index, channels_last)
        saved = resumed_state(resume_dir, config)
    else:
        data = build_federated(split_plan(config), dataset, channels_last)
    algorithm, archs = build_algorithm(config, data.input_shape, data.num_classes, data.train_counts())
    ops, client_ops = algorithm.setup.ops, algorithm.setup.client_ops
    threads = run_threads(config)  # one count for the runtime and the round loop alike
    runtime = make_runtime(config, archs, data, threads)
    if resume_dir is not None:
        state_dir = resume_dir / STATES_DIR
    simulation = simulation_for(config, algorithm, data, runtime, threads,
                                placement=Placement(config.client_states, state_dir, config.out_dir))
    if resume_dir is None:
        check_a_round_fits(config, simulation)
    if saved is not None:
        state = saved
        if not getattr(state, "optimizer_states", None) and config.keep_optimizer_state:
            state.optimizer_states = [{} for _ in range(data.num_clients)]  # a checkpoint from before the option
    else:
        state = simulation.initial_state(
            ops.initial_params(), ops.initial_buffers(),
            client_params=None if client_ops is None else [o.initial_params() for o in client_ops],
            client_buffers=None if client_ops is None else [o.initial_buffers() for o in client_ops])
    return Prepared(data, simulation, state, runtime)


def resumed_state(run_dir: Path, config: Config) -> SimState | None:
    """The state of `run_dir`'s checkpoint (None: killed before its first one), checked to be
    this run's (the identity it holds), of its clients, with its client state files in place."""
    path = run_dir / CHECKPOINT
    if not path.is_file():
        return None
    checkpoint = read_checkpoint(path, RESUME_FIX)
    if changes := changed_keys(checkpoint.run, identity(config)):
        raise RunFileError(f"{path}: written by another run ({describe_changes(changes)}); {RESUME_FIX}")
    state = checkpoint.state
    if misfit := state_misfit(state, config):
        raise RunFileError(f"{path}: does not fit this run of {config.num_clients} clients and {config.rounds} "
                           f"rounds (it holds {misfit}); {RESUME_FIX}")
    for store in disk_stores(state):
        store.reopen(run_dir / STATES_DIR)
    return state


def state_misfit(state: SimState, config: Config) -> str | None:
    """What in a checkpoint's state does not fit `config`'s clients and rounds (None: it fits)."""
    per_client = {"client states": state.clients, "BatchNorm statistics": state.buffers}
    if state.optimizer_states:
        per_client["optimizer states"] = state.optimizer_states
    for what, values in per_client.items():
        if not isinstance(values, (list, DiskStates)):
            return f"{what} of type {type(values).__name__}"
        if len(values) != config.num_clients:
            return f"{len(values)} {what}"
    if type(state.round) is not int or not 0 <= state.round <= config.rounds:
        return f"round {state.round!r}"
    if not isinstance(state.rows, list):
        return f"metrics rows of type {type(state.rows).__name__}"
    return None


def check_run_name(name: str) -> None:
    """`name` must be one plain directory name: the run directory goes inside `out_dir`, never
    beside or above it."""
    separators = {"/", "\\", os.sep, os.altsep} - {None}
    if not name.strip() or name in (".", "..") or any(sep in name for sep in separators) or "\0" in name:
        raise ConfigError(f"name: {name!r} is not a plain directory name (no '/', '\\', '..' or empty name); "
                          "the run directory goes inside out_dir: choose the place with out_dir=PATH")


def default_run_name(config: Config) -> str:
    from pfedkit.data.hf import file_label  # hf:path/to/folder -> hf-folder

    return f"{config.algorithm}-{file_label(config.dataset)}-{datetime.now():%Y%m%d-%H%M%S}"


def claim_run_dir(config: Config) -> Path:
    """A new run directory under `out_dir`, created: `name` (default algorithm-dataset-timestamp),
    or `name-2`, `name-3`... when taken. `mkdir` without exist_ok is the claim, so two runs
    started in the same second (or with the same name) never share or reuse a directory."""
    base = config.name if config.name is not None else default_run_name(config)
    check_run_name(base)
    out = Path(config.out_dir)
    suffix = 1
    while True:
        candidate = out / (base if suffix == 1 else f"{base}-{suffix}")
        try:
            candidate.mkdir(parents=True)  # creates out_dir if needed; the run directory itself never exists yet
            return candidate
        except FileExistsError:  # taken (by an earlier run or one starting right now): the next name
            suffix += 1


def discard_run_dir(run_dir: Path, remove_out_dir: bool = False) -> None:
    """Remove a run directory whose setup failed, and its `out_dir` when this run created it and
    nothing else is in it."""
    shutil.rmtree(run_dir, ignore_errors=True)
    if remove_out_dir:
        try:
            run_dir.parent.rmdir()
        except OSError:  # another run is using it
            pass


def execute(config: Config, context: Prepared, run_dir: Path, quiet: bool = True) -> Result:
    sim, state = context.simulation, context.state
    bar = tqdm(total=config.rounds, initial=state.round, disable=quiet, unit="round",
               desc=f"{config.algorithm} {config.dataset}", dynamic_ncols=True)
    budget = privacy_budget(config, sim)
    try:
        while state.round < config.rounds:
            if budget is not None and (stop := budget.exhausted(state.rows, state.round,
                                                                budget.participants(state.round + 1))):
                tqdm.write(stop, file=sys.stderr)  # a normal end: the rounds done are written, the summary follows
                if state.round:  # checkpoint_every may have skipped it
                    save_progress(run_dir, state, identity(config), checkpoint=context.resumable)
                break
            try:
                report = sim.run_round(state)
            except TrainingDiverged as err:
                keep_completed_rounds(run_dir, state, config, err)
                raise
            if budget is not None:
                budget.write_epsilon(state.rows, state.round)
                if over := budget.overshoot(state.rows, state.round):
                    tqdm.write(over, file=sys.stderr)  # the next check stops the run: epsilon only grows
            if report.acc_weighted is not None:
                bar.set_postfix(acc=f"{report.acc_weighted:.4f}")
            bar.update(1)
            # Metrics every round (a kill loses no finished round's numbers); the checkpoint, the
            # costly part, every `checkpoint_every` rounds (a resume repeats the rounds after it).
            due = state.round % config.checkpoint_every == 0 or state.round == config.rounds
            save_progress(run_dir, state, identity(config), checkpoint=context.resumable and due)
    finally:
        bar.close()
        context.runtime.close()
    metrics = pd.DataFrame(state.rows)
    # The summary's `device`: where the clients trained, as their side says (Flower nodes choose their own).
    return Result(finish_summary(run_dir, state, config, context.data, context.backend,
                                 sim.clients.describe_devices(), budget),
                  metrics, run_dir)


def keep_completed_rounds(run_dir: Path, state: SimState, config: Config, err: TrainingDiverged) -> None:
    """A diverged round: write the metrics of the rounds before it (its own state is half
    updated, so no checkpoint) and tell the user what to change."""
    if state.rows:
        atomic_write_text(run_dir / "metrics.csv", pd.DataFrame(state.rows).to_csv(index=False))
    clip = f"a smaller grad_clip (now {config.grad_clip})" if config.grad_clip else "grad_clip=1.0"
    rounds = "round 1" if state.round == 1 else f"rounds 1-{state.round}"
    kept = f"the metrics of {rounds}" if state.round else "its config and partition"
    err.hint = f"lower lr (now {config.lr}) or set {clip}, then start a new run; {run_dir} keeps {kept}"


def save_progress(run_dir: Path, state: SimState, run: dict[str, Any], checkpoint: bool = True) -> None:
    """Metrics first, then the checkpoint (with `run`, the run's identity): a kill between them
    only repeats a round on resume."""
    metrics = pd.DataFrame(state.rows)
    atomic_write_text(run_dir / "metrics.csv", metrics.to_csv(index=False))
    if checkpoint:
        stores = disk_stores(state)
        for store in stores:
            store.sync()  # the files the checkpoint names are on disk before it is
        write_checkpoint(run_dir / CHECKPOINT, state, run)
        for store in stores:
            store.pin()
    if state.diagnostics:
        write_data(run_dir / DIAGNOSTICS, state.diagnostics)


def finish_summary(run_dir: Path, state: SimState, config: Config, data: FederatedData,
                   backend: str | None = None, device: str = "cpu",
                   budget: Any = None) -> dict[str, Any]:
    metrics = pd.DataFrame(state.rows)
    summary = summarize(metrics, algorithm=config.algorithm, dataset=config.dataset, rounds=config.rounds,
                        class_correct=state.class_correct, class_total=state.class_total,
                        train_counts=data.train_counts(), weighting=config.headline.weighting,
                        point=config.headline.point, eval_point=config.eval_point,
                        new_client_finetune=config.new_client_finetune)
    summary.update({"model": model_name(config), "num_clients": config.num_clients,
                    "partition": config.partition.scheme, "backend": backend or config.backend,
                    "device": device,
                    "seconds": round(state.seconds, 3),
                    "sec_per_round": round(state.seconds_per_round(), 4),  # after each process's first round
                    "sec_first_round": round(state.seconds_first_round() or 0.0, 4),
                    "run_dir": str(run_dir)})
    if budget is not None:  # dp: the guarantee of the rounds done (docs/privacy.md)
        summary.update(budget.summary(state.rows, state.round, config.rounds))
    atomic_write_json(run_dir / "summary.json", summary)  # strict JSON: NaN and infinities as null
    write_client_tables(run_dir, state, data)
    return summary


def write_client_tables(run_dir: Path, state: SimState, data: FederatedData) -> None:
    """clients.npz: per client x class, the data (train/test counts) and, at the last evaluation,
    the correct counts and the output layer's row norms: what `pfedkit report` draws as heatmaps."""
    arrays = {"train_counts": data.train_counts(), "test_counts": data.test_counts()}
    for name in ("class_correct", "class_total", "head_row_norms"):
        if getattr(state, name, None) is not None:
            arrays[name] = getattr(state, name)
    atomic_savez(run_dir / "clients.npz", **arrays)
