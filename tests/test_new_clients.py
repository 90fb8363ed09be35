"""Clients that never train (config `new_clients`, `new_client_finetune`): generalisation to new
clients. They are never sampled, asked for reports, trained or aggregated; after each evaluation
round each receives `Algorithm.joining_model`, trains `new_client_finetune` epochs on its own
training split and is evaluated on its test split."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import quick_options

import pfedkit
from pfedkit.algorithms import algorithm_names
from pfedkit.build import train_settings
from pfedkit.config import load_config
from pfedkit.core.contract import Fit
from pfedkit.core.errors import ConfigError
from pfedkit.core.seeds import sample_clients
from pfedkit.engine.local_clients import NEW_CLIENT_PURPOSE
from pfedkit.engine.simulate import choose_new_clients
from pfedkit.engine.trainer import FitJob, LocalTrainer
from pfedkit.evaluation import summarize
from pfedkit.runs import prepare

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LEGACY_COLUMNS = ["round", "client", "participated", "n_train", "n_test", "correct", "accuracy", "loss",
                  "balanced_acc", "train_loss", "train_steps", "bytes_down", "bytes_up", "dropped"]


def base(tmp_path, **changes) -> dict:
    config = {"algorithm": "fedavg", "dataset": "digits", "num_clients": 6, "rounds": 3, "threads": 1,
              "batch_size": 20, "lr": 0.05, "seed": 3, "join_ratio": 0.5, "out_dir": str(tmp_path / "runs"),
              "partition": {"scheme": "dirichlet", "alpha": 0.5}}
    config.update(changes)
    return config


def prepared(config: dict, tmp_path):
    """The run's simulation and initial state, without a run directory."""
    return prepare(load_config(config), state_dir=tmp_path / "states")


def test_same_seed_same_new_clients_and_different_seeds_differ():
    assert choose_new_clients(7, 20, 5) == choose_new_clients(7, 20, 5)
    assert len(set(choose_new_clients(7, 20, 5))) == 5
    draws = {tuple(choose_new_clients(seed, 20, 5)) for seed in range(10)}
    assert len(draws) > 1
    assert choose_new_clients(7, 20, 0) == []


@pytest.mark.parametrize("changes", [{"new_clients": 6}, {"new_clients": 9}, {"new_clients": -1},
                                     {"new_client_finetune": -2}])
def test_bad_values_are_one_line_config_errors(changes, tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(base(tmp_path, **changes))
    message = str(err.value)
    assert "\n" not in message and next(iter(changes)) in message


def test_refusing_algorithm_says_so_in_one_line_before_any_run_directory(tmp_path):
    config = base(tmp_path, algorithm="dapfl", new_clients=1)
    with pytest.raises(ConfigError) as err:
        pfedkit.run(config)
    assert "\n" not in str(err.value) and "dapfl" in str(err.value) and "new_clients" in str(err.value)
    assert not (tmp_path / "runs").exists()


def test_new_clients_are_never_sampled_reported_trained_or_aggregated(tmp_path, monkeypatch):
    """A probe on every path into training: client_update, client_report (the setup exchange of
    round 0 included), the aggregation and the runtime's Fit jobs. New clients reach the runtime
    only as fine-tuning jobs (purpose new-client)."""
    from pfedkit.algorithms.fedavg import FedAvg

    asked = set()

    def probe_report(self, rnd, cid, client, data):
        asked.add((rnd, cid))
        return None  # FedAvg sends nothing: the same run

    monkeypatch.setattr(FedAvg, "client_report", probe_report)
    context = prepared(base(tmp_path, new_clients=2, new_client_finetune=1, rounds=4), tmp_path)
    sim, state, algo, runtime = context.simulation, context.state, context.simulation.algorithm, context.runtime
    new = set(sim.new_clients)
    assert len(new) == 2
    seen = {"update": set(), "report": set(), "aggregate": set(), "fit": set(), "finetune": set()}
    update, start_aggregation = algo.client_update, algo.start_aggregation
    fit_stream, fit_many = runtime.fit_stream, runtime.fit_many

    def probe_update(rnd, cid, *rest):
        seen["update"].add(cid)
        return update(rnd, cid, *rest)

    def probe_aggregation(rnd, server, cids):
        seen["aggregate"].update(cids)
        return start_aggregation(rnd, server, cids)

    def record_jobs(jobs):
        for job in jobs:
            seen["finetune" if job.purpose == NEW_CLIENT_PURPOSE else "fit"].add(job.cid)

    def probe_stream(jobs):
        record_jobs(jobs)
        return fit_stream(jobs)

    def probe_many(jobs):  # (a runtime's fit_many may itself go through fit_stream: recorded twice, harmless)
        record_jobs(jobs)
        return fit_many(jobs)

    algo.client_update, algo.start_aggregation = probe_update, probe_aggregation
    runtime.fit_stream, runtime.fit_many = probe_stream, probe_many
    participants = set()
    for _ in range(4):
        participants.update(sim.run_round(state).participants)
    assert participants and not participants & new
    assert seen["update"] and not seen["update"] & new
    assert seen["aggregate"] and not seen["aggregate"] & new
    assert {cid for rnd, cid in asked if rnd == 0} == set(range(6)) - new  # the setup exchange
    assert asked and not {cid for _, cid in asked} & new
    assert seen["fit"] and not seen["fit"] & new
    assert seen["finetune"] == new  # fine-tuned, for evaluation only
    rows = pd.DataFrame(state.rows)
    newcomers = rows[rows["new_client"] == 1]
    assert set(newcomers["client"]) == new
    assert (newcomers["participated"] == 0).all() and (newcomers["train_steps"] == 0).all()
    assert (newcomers[["bytes_up", "bytes_down"]] == 0).all().all()
    assert newcomers["accuracy"].between(0, 1).all() and len(newcomers) == 2 * 4


def test_fine_tuning_never_changes_the_participants_numbers(tmp_path):
    """The new clients' fine-tuning is thrown away: participants' rows are identical for E = 0 and E = 2."""
    without = pfedkit.run(base(tmp_path, new_clients=2, new_client_finetune=0, name="e0")).metrics
    with_finetune = pfedkit.run(base(tmp_path, new_clients=2, new_client_finetune=2, name="e2")).metrics
    old = without["new_client"] == 0
    pd.testing.assert_frame_equal(without[old], with_finetune[old])
    assert not np.array_equal(without.loc[~old, "loss"], with_finetune.loc[~old, "loss"])


def test_fedavg_new_client_without_finetune_is_the_global_model_on_its_test_split(tmp_path):
    context = prepared(base(tmp_path, new_clients=2, new_client_finetune=0, rounds=2), tmp_path)
    sim, state = context.simulation, context.state
    ops = sim.algorithm.setup.ops
    for _ in range(2):
        sim.run_round(state)
        rows = pd.DataFrame(state.rows)
        for cid in sim.new_clients:
            data = context.data.clients[cid]
            with torch.no_grad():
                logits = ops.logits(state.server["params"], data.x_test, state.buffers[cid])
            correct = int((logits.argmax(dim=1) == data.y_test).sum())
            row = rows[(rows["round"] == state.round) & (rows["client"] == cid)].iloc[0]
            assert row["correct"] == correct and row["n_test"] == data.n_test


def test_finetuning_is_E_epochs_of_the_trainer_from_the_received_model(tmp_path):
    config = load_config(base(tmp_path, new_clients=1, new_client_finetune=2, rounds=1))
    context = prepare(config, state_dir=tmp_path / "states")
    sim, state = context.simulation, context.state
    sim.run_round(state)
    (cid,) = sim.new_clients
    data = context.data.clients[cid]
    trainer = LocalTrainer(sim.algorithm.setup.ops.build, train_settings(config))
    job = FitJob(1, cid, 0, Fit(state.server["params"], epochs=2), state.buffers[cid], None,
                 purpose=NEW_CLIENT_PURPOSE)
    outcome = trainer.fit(job, data.x_train, data.y_train)
    assert outcome.steps == 2 * -(-data.n_train // config.batch_size)  # two epochs of mini-batches
    with torch.no_grad():
        logits = sim.algorithm.setup.ops.logits(outcome.params, data.x_test, outcome.buffers)
    row = pd.DataFrame(state.rows).query("client == @cid").iloc[0]
    assert row["correct"] == int((logits.argmax(dim=1) == data.y_test).sum())
    loss = float(torch.nn.functional.cross_entropy(logits, data.y_test))
    assert row["loss"] == pytest.approx(loss, rel=1e-5)


def test_a_knnper_newcomer_predicts_with_a_datastore_of_its_finetuned_model(tmp_path):
    """`evaluation_state` sees the model a newcomer is measured with (after its fine-tuning): its
    datastore embeds the training split with that model, whose head it mixes with (lam 0.5)."""
    from pfedkit.algorithms.knnper import interpolated_logits, knn_distribution

    config = load_config(base(tmp_path, algorithm="knnper", new_clients=1, new_client_finetune=1, rounds=1,
                              knnper={"k": 3}))
    context = prepare(config, state_dir=tmp_path / "states")
    sim, state = context.simulation, context.state
    sim.run_round(state)
    (cid,) = sim.new_clients
    data, ops = context.data.clients[cid], sim.algorithm.setup.ops
    trainer = LocalTrainer(ops.build, train_settings(config))
    outcome = trainer.fit(FitJob(1, cid, 0, Fit(state.server["params"], epochs=1), state.buffers[cid], None,
                                 purpose=NEW_CLIENT_PURPOSE), data.x_train, data.y_train)
    with torch.no_grad():
        keys = ops.features(outcome.params, data.x_train, outcome.buffers)
        features = ops.features(outcome.params, data.x_test, outcome.buffers)
        knn = knn_distribution(features, keys, data.y_train, k=3, scale=1.0, num_classes=10)
        logits = interpolated_logits(ops.head_logits(outcome.params, features), knn, 0.5, "probabilities")
    row = pd.DataFrame(state.rows).query("client == @cid").iloc[0]
    assert row["correct"] == int((logits.argmax(dim=1) == data.y_test).sum())
    assert row["loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, data.y_test)), rel=1e-5)


@dataclasses.dataclass
class FinetunedNewcomer:
    """One round run with one newcomer, and our own copy of its fine-tuning."""
    state: Any
    cid: int
    fresh: Any  # its state when it joins (`joining_state`)
    data: Any
    outcome: Any  # its fine-tuned model and BatchNorm statistics
    row: pd.Series  # its metrics row

    def features(self, algo) -> torch.Tensor:
        with torch.no_grad():
            return algo.setup.ops.features(self.outcome.params, self.data.x_test, self.outcome.buffers)


def finetuned_newcomer(tmp_path, algorithm: str, **options) -> tuple[Any, FinetunedNewcomer]:
    config = load_config(base(tmp_path, algorithm=algorithm, new_clients=1, new_client_finetune=1, rounds=1,
                              **options))
    context = prepare(config, state_dir=tmp_path / "states")
    sim, state = context.simulation, context.state
    sim.run_round(state)
    (cid,) = sim.new_clients
    algo, data = sim.algorithm, context.data.clients[cid]
    fresh = algo.joining_state(cid, state.server, state.clients[cid], data)
    received = algo.joining_model(cid, state.server, fresh, data)
    trainer = LocalTrainer(algo.setup.ops.build, train_settings(config))
    outcome = trainer.fit(FitJob(1, cid, 0, Fit(received, epochs=1), state.buffers[cid], None,
                                 purpose=NEW_CLIENT_PURPOSE), data.x_train, data.y_train)
    row = pd.DataFrame(state.rows).query("client == @cid").iloc[0]
    return algo, FinetunedNewcomer(state, cid, fresh, data, outcome, row)


@pytest.mark.parametrize(("algorithm", "options"), [("gpfl", {}), ("fedcp", {}),
                                                   ("pfedcs", {"pfedcs": {"logit_normalisation": "l2"}})])
def test_a_newcomer_whose_prediction_reads_its_head_from_the_state_predicts_with_its_finetuned_head(
        algorithm, options, tmp_path):
    """GPFL's valve, FedCP's policy and pFedCS's normalisation read `client["head"]`: a newcomer's
    is the head its fine-tuning trained (`evaluation_state`), not the initial one it received."""
    from pfedkit.core.params import select

    algo, new = finetuned_newcomer(tmp_path, algorithm, **options)

    def measured(head) -> tuple[int, float]:
        with torch.no_grad():
            logits = algo.predict(new.cid, new.state.server, {**new.fresh, "head": head}, new.features(algo))
        loss = float(torch.nn.functional.cross_entropy(logits, new.data.y_test))
        return int((logits.argmax(dim=1) == new.data.y_test).sum()), loss

    finetuned, initial = measured(select(new.outcome.params, "head")), measured(new.fresh["head"])
    assert new.row["correct"] == finetuned[0] and new.row["loss"] == pytest.approx(finetuned[1], rel=1e-5)
    assert initial[1] != pytest.approx(finetuned[1], rel=1e-3)  # the test can tell them apart


def test_a_fednh_newcomer_scores_with_the_prototypes_its_finetuning_trained(tmp_path):
    """FedNH's cosine logits read mu from `evaluation_state`: a newcomer's mu is the head weight
    its fine-tuning trained, with the server's s, not the server's prototypes."""
    from pfedkit.algorithms.fednh import cosine_logits

    algo, new = finetuned_newcomer(tmp_path, "fednh")
    server = new.state.server

    def measured(prototypes) -> float:
        logits = cosine_logits(new.features(algo), prototypes, server["scale"])
        return float(torch.nn.functional.cross_entropy(logits, new.data.y_test))

    finetuned, initial = measured(new.outcome.params[algo.weight_name]), measured(server["prototypes"])
    assert new.row["loss"] == pytest.approx(finetuned, rel=1e-5)
    assert initial != pytest.approx(finetuned, rel=1e-3)  # the test can tell them apart


def test_no_new_clients_keeps_the_metrics_columns_and_the_sampling(tmp_path):
    """new_clients=0: no `new_client` column (metrics.csv as before this option) and the round's
    participants are exactly `sample_clients` over all N clients, as before."""
    result = pfedkit.run(base(tmp_path))
    assert list(result.metrics.columns) == LEGACY_COLUMNS
    for rnd, rows in result.metrics.groupby("round"):
        assert sorted(rows.loc[rows["participated"] == 1, "client"]) == sample_clients(3, rnd, 6, 0.5)
    assert "new_clients_final_acc" not in result.summary


def test_sampling_draws_join_ratio_of_the_training_clients_only(tmp_path):
    result = pfedkit.run(base(tmp_path, new_clients=2, rounds=4))
    metrics, new = result.metrics, result.summary["new_clients"]
    training = [cid for cid in range(6) if cid not in new]
    for rnd, rows in metrics.groupby("round"):
        chosen = sorted(rows.loc[rows["participated"] == 1, "client"])
        assert chosen == [training[k] for k in sample_clients(3, rnd, 4, 0.5)]  # 2 of the 4 training clients


def test_summary_separates_participants_from_new_clients():
    rows = []
    for rnd in (1, 2):
        for cid, (correct, new) in enumerate([(8, 0), (6, 0), (3, 1)]):
            rows.append({"round": rnd, "client": cid, "participated": 1 - new, "n_train": 10, "n_test": 10,
                         "correct": correct + rnd, "accuracy": (correct + rnd) / 10, "loss": 1.0, "balanced_acc": 0.5,
                         "train_loss": 1.0, "train_steps": 1, "bytes_down": 0, "bytes_up": 0, "dropped": 0,
                         "new_client": new})
    summary = summarize(pd.DataFrame(rows), algorithm="fedavg", dataset="digits", rounds=2, class_correct=None,
                        class_total=None, train_counts=np.ones((3, 2)), point="final", new_client_finetune=3)
    assert summary["final_acc"] == pytest.approx((10 + 8) / 20)  # participants only
    assert summary["new_clients_final_acc"] == pytest.approx(5 / 10)
    assert summary["new_clients_best_acc"] == pytest.approx(5 / 10)
    assert summary["new_clients_headline_acc"] == summary["new_clients_final_acc"]
    assert summary["new_clients"] == [2] and summary["new_client_finetune"] == 3


@pytest.mark.parametrize("backend", ["vectorized", "processes"])
def test_backends_agree_on_new_clients(backend, tmp_path):
    config = base(tmp_path, new_clients=2, new_client_finetune=1, rounds=2)
    sequential = pfedkit.run({**config, "backend": "sequential", "name": "s"})
    other = pfedkit.run({**config, "backend": backend, "name": backend, **({"workers": 2} if backend == "processes" else {})})
    if backend == "processes":
        assert (sequential.run_dir / "metrics.csv").read_bytes() == (other.run_dir / "metrics.csv").read_bytes()
    else:  # batched kernels: equal up to float reassociation
        np.testing.assert_allclose(other.metrics["accuracy"], sequential.metrics["accuracy"], atol=1e-4)
        np.testing.assert_allclose(other.metrics["loss"], sequential.metrics["loss"], atol=1e-4)
    assert sequential.summary["new_clients"] == other.summary["new_clients"]


def refusal_at_defaults(algorithm: str, tmp_path) -> str | None:
    """Why `algorithm`, built at its default options, refuses new clients (`new_client_refusal`);
    None: it takes them."""
    context = prepared(base(tmp_path, algorithm=algorithm, **quick_options(algorithm)), tmp_path)
    context.runtime.close()
    return context.simulation.algorithm.new_client_refusal()


@pytest.mark.parametrize("algorithm", algorithm_names())
def test_every_algorithm_supports_new_clients_or_refuses_in_one_line(algorithm, tmp_path):
    """A run with a new client refuses exactly when the class gives a reason, in one line that says it."""
    reason = refusal_at_defaults(algorithm, tmp_path)
    config = {"algorithm": algorithm, "dataset": "digits", "num_clients": 4, "rounds": 1, "threads": 1,
              "batch_size": 20, "seed": 1, "new_clients": 1, "new_client_finetune": 1,
              "out_dir": str(tmp_path / "runs"), "partition": {"scheme": "dirichlet", "alpha": 0.5},
              **quick_options(algorithm)}
    try:
        result = pfedkit.run(config)
    except ConfigError as err:
        message = str(err)
        assert reason is not None, f"{algorithm} refuses new clients, but its new_client_refusal() is None: {message}"
        assert "\n" not in message and f"algorithm {algorithm} " in message and "new_clients" in message
        assert reason in message
        return
    assert reason is None, f"{algorithm} says it cannot take new clients ({reason}), yet the run took one"
    newcomers = result.metrics[result.metrics["new_client"] == 1]
    assert len(newcomers) == 1 and newcomers["participated"].eq(0).all()
    assert newcomers["accuracy"].between(0, 1).all() and np.isfinite(newcomers["loss"]).all()
    assert result.summary["new_clients_final_acc"] is not None


def _records(summaries: list[dict]):
    from pathlib import Path

    from pfedkit.experiments.comparison import Entry, RunRecord

    base_summary = {"best_acc": 0.9, "last5_acc": 0.8, "bytes_up": 0, "bytes_down": 0, "rounds_done": 1}
    return [RunRecord(Entry(label, {}), seed, Path("."), {**base_summary, **summary})
            for seed, (label, summary) in enumerate(summaries)]


def test_comparison_shows_a_new_clients_column_only_when_runs_have_new_clients():
    from pfedkit.experiments.comparison import markdown_table, seed_table
    from pfedkit.report.comparison_report import seed_cells

    plain = seed_table(_records([("fedavg", {}), ("ifca", {})]))
    assert "new_clients_mean" not in plain
    assert "new_clients" not in markdown_table(plain, ("best", "last5"))
    with_new = seed_table(_records([("fedavg", {"new_clients_last5_acc": 0.5}),
                                    ("fedavg", {"new_clients_last5_acc": 0.7}), ("ifca", {})]))
    assert with_new.loc[("", "fedavg"), "new_clients_mean"] == pytest.approx(0.6)
    assert np.isnan(with_new.loc[("", "ifca"), "new_clients_mean"])
    header = markdown_table(with_new, ("best", "last5", "s_per_round")).splitlines()[0]
    assert [c.strip() for c in header.strip("|").split("|")] == ["method", "seeds", "best", "last5", "new_clients",
                                                                 "s_per_round"]
    assert "60.00 ± 10.00" in markdown_table(with_new, ("last5",))
    csv_like = with_new.reset_index()
    assert "new_clients" in seed_cells(csv_like, ("last5", "new_clients")).columns


@pytest.mark.parametrize("algorithm, key", [("ifca", "models"), ("cfl", "models"), ("fesem", "centres"),
                                            ("fedsoft", "centres")])
def test_cluster_methods_give_a_newcomer_the_model_that_fits_its_data_best(algorithm, key, tmp_path):
    """Among the server's models, one trained on the newcomer's own data (lowest loss) is chosen,
    wherever it sits in the list; the client's never-updated membership would say model 0."""
    context = prepared(base(tmp_path, algorithm=algorithm, new_clients=1, new_client_finetune=0, rounds=1), tmp_path)
    sim, state = context.simulation, context.state
    (cid,) = sim.new_clients
    data = context.data.clients[cid]
    initial = sim.algorithm.setup.ops.initial_params()
    trainer = LocalTrainer(sim.algorithm.setup.ops.build, train_settings(load_config(base(tmp_path))))
    fitted = trainer.fit(FitJob(1, cid, 0, Fit(initial, epochs=3), None), data.x_train, data.y_train).params
    for position in (1, 2):
        models = [initial, initial, initial]
        models[position] = fitted
        server = {**state.server, key: models}
        chosen = sim.algorithm.joining_model(cid, server, state.clients[cid], sim.clients.client_view(cid, state))
        assert chosen is fitted
