"""Evaluation protocol (design.md, settings.md §4): per-client metrics and run summaries.

Per round and client we measure the model that client would actually use (the algorithm's
`client_model`) on its own test split. Summaries report both the sample-weighted mean
(PFLlib/FedReMa/cwFedAvg tables) and the unweighted mean over clients (DA-PFL, pFedPM, PFedCS),
the best round (chosen on the test set, hence optimistic) and the mean of the last 5 evaluated
rounds, balanced accuracy, and DA-PFL's many/medium/few class-group accuracy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

# DA-PFL Table IV thresholds on a client's training count of a class (settings.md §4.4).
FEW_BELOW = 30
MANY_ABOVE = 80
LAST_K = 5
LAST_K_LONG = 10  # DA-PFL and PFedCS report the mean of the last 10 rounds
HEADLINE_WORDS = {
    "weighted": "sample-weighted mean accuracy over clients",
    "unweighted": "unweighted mean accuracy over clients",
    "best": "best round (chosen on the test splits, optimistic)",
    "last5": "mean of the last 5 evaluated rounds",
    "last10": "mean of the last 10 evaluated rounds",
    "final": "last evaluated round",
}


@dataclass
class ClientEval:
    correct: int
    n_test: int
    loss_sum: float
    class_correct: np.ndarray  # [C]
    class_total: np.ndarray    # [C]

    @property
    def accuracy(self) -> float:
        return self.correct / self.n_test if self.n_test else float("nan")

    @property
    def loss(self) -> float:
        return self.loss_sum / self.n_test if self.n_test else float("nan")

    @property
    def balanced_accuracy(self) -> float:
        present = self.class_total > 0
        if not present.any():
            return float("nan")
        return float(np.mean(self.class_correct[present] / self.class_total[present]))


# Evaluation batch: big enough for efficient kernels, small enough that a conv model's activations
# stay in cache. FedAvgCNN forward on this CPU, 1 thread: 56 GFLOP/s at 200 samples, 32 at 1,000.
EVAL_BATCH = 200


@torch.inference_mode()
def evaluate_logits_fn(logits_fn, x: torch.Tensor, y: torch.Tensor, num_classes: int,
                       batch_size: int = EVAL_BATCH) -> ClientEval:
    """Accuracy, summed loss and per-class counts of `logits_fn` over (x, y) in batches."""
    correct, loss_sum = 0, 0.0
    class_correct = torch.zeros(num_classes, dtype=torch.int64)
    for start in range(0, len(y), batch_size):
        xb, yb = x[start:start + batch_size], y[start:start + batch_size]
        logits = logits_fn(xb).float()
        loss_sum += float(F.cross_entropy(logits, yb, reduction="sum"))
        hits = logits.argmax(dim=1) == yb
        correct += int(hits.sum())
        class_correct += torch.bincount(yb[hits], minlength=num_classes).cpu()
    class_total = torch.bincount(y, minlength=num_classes).cpu().numpy()
    return ClientEval(correct, len(y), loss_sum, class_correct.numpy(), class_total)


def classifier_row_norms(params: dict[str, torch.Tensor], num_classes: int) -> np.ndarray:
    """L2 norm of each class's row of the output layer (the last 2-d `head.` weight with one row
    per class): cwFedAvg Fig. 3/6 reads a client's class distribution from them. nan if none."""
    rows = [value for name, value in params.items()
            if name.startswith("head.") and name.endswith("weight") and value.dim() == 2
            and value.shape[0] == num_classes]
    if not rows:
        return np.full(num_classes, np.nan)
    return rows[-1].detach().float().norm(dim=1).cpu().numpy()


def round_table(metrics: pd.DataFrame) -> pd.DataFrame:
    """One row per evaluated round: weighted and unweighted mean accuracy, std, worst client."""
    evaluated = metrics.dropna(subset=["accuracy"])
    grouped = evaluated.groupby("round")
    return pd.DataFrame({
        "acc_weighted": grouped["correct"].sum() / grouped["n_test"].sum(),
        "acc_mean": grouped["accuracy"].mean(),
        "acc_std": grouped["accuracy"].std(ddof=0),
        "acc_worst": grouped["accuracy"].min(),
        "balanced_acc": grouped["balanced_acc"].mean(),
        "loss": grouped["loss"].mean(),
    })


def group_accuracy(class_correct: np.ndarray, class_total: np.ndarray, train_counts: np.ndarray) -> dict[str, float]:
    """Pooled accuracy on classes a client has few (<30), medium (30-80) or many (>80) training
    samples of; classes absent from its training data form the 'absent' group."""
    groups = {
        "few": (train_counts > 0) & (train_counts < FEW_BELOW),
        "medium": (train_counts >= FEW_BELOW) & (train_counts <= MANY_ABOVE),
        "many": train_counts > MANY_ABOVE,
        "absent": train_counts == 0,
    }
    out = {}
    for name, mask in groups.items():
        total = class_total[mask].sum()
        out[name] = float(class_correct[mask].sum() / total) if total else float("nan")
    return out


def summarize(metrics: pd.DataFrame, *, algorithm: str, dataset: str, rounds: int,
              class_correct: np.ndarray | None, class_total: np.ndarray | None,
              train_counts: np.ndarray, weighting: str = "weighted", point: str = "best",
              eval_point: str = "after_download", new_client_finetune: int = 0) -> dict:
    """The run's summary.json content: every number, and `headline_acc`, the one chosen by
    (`weighting`, `point`) with `headline` saying in words which it is.

    With new clients (config `new_clients`: metrics has a `new_client` column), every accuracy
    above is the participants' (the clients that train) and `new_clients_*` the same numbers over
    the new clients alone (`new_clients_headline_acc` chosen as `headline_acc`)."""
    new_ids: list[int] = []
    if "new_client" in metrics.columns:
        is_new = metrics["new_client"] == 1
        new_ids = sorted(int(c) for c in metrics.loc[is_new, "client"].unique())
        newcomers, metrics = metrics[is_new], metrics[~is_new]
    table = round_table(metrics)
    summary = {
        "algorithm": algorithm,
        "dataset": dataset,
        "rounds": rounds,
        "rounds_done": int(metrics["round"].max()) if len(metrics) else 0,
        "best_round": int(table["acc_weighted"].idxmax()) if len(table) else None,
        **accuracy_numbers(table),
        "bytes_up": int(metrics["bytes_up"].sum()),
        "bytes_down": int(metrics["bytes_down"].sum()),
        # one-off setup exchange (round 0), included in bytes_up; settings.md §4.6 reports it apart
        "bytes_setup": int(metrics.loc[metrics["round"] == 0, "bytes_up"].sum()),
    }
    summary.update(steps_per_round(metrics))
    if len(table):
        summary["clients"] = client_accuracies(metrics, table)
    key = ("final_acc" if point == "final" else f"{point}_acc") + ("_unweighted" if weighting == "unweighted" else "")
    summary["headline_acc"] = summary[key]
    summary["headline"] = f"{HEADLINE_WORDS[weighting]}, {HEADLINE_WORDS[point]}; evaluated {eval_point.replace('_', ' ')}"
    if class_correct is not None and class_total is not None:
        keep = np.setdiff1d(np.arange(len(class_correct)), new_ids)  # the participants' side
        summary["final_group_acc"] = group_accuracy(class_correct[keep], class_total[keep], train_counts[keep])
    if new_ids:
        summary.update(new_client_summary(newcomers, new_ids, new_client_finetune, key))
    return summary


def client_accuracies(metrics: pd.DataFrame, table: pd.DataFrame) -> dict[str, list]:
    """Each client's accuracy, so that two runs on the same partition (same seed) can be compared
    client by client (pfedkit.experiments.verdicts): `client` ids, their test counts `n_test`, and
    their accuracy at the last evaluated round (`final_acc`), mean over the last 5 and 10 evaluated
    rounds (`last5_acc`, `last10_acc`), at the best round of the sample-weighted mean (`best_acc`)
    and of the unweighted mean (`best_acc_unweighted`). sum(n_test * final_acc) / sum(n_test) is
    the summary's final_acc."""
    evaluated = metrics.dropna(subset=["accuracy"])
    by_round = evaluated.pivot_table(index="round", columns="client", values="accuracy", aggfunc="first")
    counts = evaluated.groupby("client")["n_test"].first().reindex(by_round.columns)
    rounds = table.index  # the evaluated rounds, in order

    def at(selected) -> list[float | None]:
        return [_num(value) for value in by_round.loc[selected].mean(axis=0)]

    return {"client": [int(c) for c in by_round.columns], "n_test": [int(n) for n in counts],
            "final_acc": at(rounds[-1:]), "last5_acc": at(rounds[-LAST_K:]), "last10_acc": at(rounds[-LAST_K_LONG:]),
            "best_acc": at([table["acc_weighted"].idxmax()]), "best_acc_unweighted": at([table["acc_mean"].idxmax()])}


def steps_per_round(metrics: pd.DataFrame) -> dict:
    """`train_steps_mean/min/max`: the local SGD steps of one participant in one round (a
    participant whose reply never came left out): the regime a paper's setting is compared by."""
    if "train_steps" not in metrics.columns or "participated" not in metrics.columns:
        return {}
    trained = (metrics["round"] >= 1) & (metrics["participated"] == 1)
    if "dropped" in metrics.columns:
        trained &= metrics["dropped"] == 0
    steps = metrics.loc[trained, "train_steps"]
    if steps.empty:
        return {"train_steps_mean": None, "train_steps_min": None, "train_steps_max": None}
    return {"train_steps_mean": float(steps.mean()), "train_steps_min": int(steps.min()),
            "train_steps_max": int(steps.max())}


def new_client_summary(newcomers: pd.DataFrame, new_ids: list[int], finetune_epochs: int, headline_key: str) -> dict:
    """`new_clients_*`: the clients that never trained, evaluated after receiving what a joining
    client would and `finetune_epochs` local epochs (best round chosen on their own test splits)."""
    numbers = accuracy_numbers(round_table(newcomers))
    out = {"new_clients": new_ids, "new_client_finetune": int(finetune_epochs)}
    out.update({f"new_clients_{name}": value for name, value in numbers.items()})
    out["new_clients_headline_acc"] = numbers[headline_key]
    return out


def accuracy_numbers(table: pd.DataFrame) -> dict:
    """Best, last-5, last-10 and final accuracy (weighted, then unweighted) and the final round's
    spread of a `round_table`: the accuracy part of a summary."""
    last, last_long = table.tail(LAST_K), table.tail(LAST_K_LONG)
    # the 10 evaluated rounds before the last 10: last10 - prev10 says whether a run has settled
    before_long = table.iloc[-2 * LAST_K_LONG:-LAST_K_LONG] if len(table) >= 2 * LAST_K_LONG else table.iloc[:0]
    final = table.iloc[-1] if len(table) else None

    def at_final(column: str) -> float | None:
        return _num(final[column]) if final is not None else None

    return {
        "best_acc": _num(table["acc_weighted"].max()),
        "last5_acc": _num(last["acc_weighted"].mean()),
        "last10_acc": _num(last_long["acc_weighted"].mean()),
        "final_acc": at_final("acc_weighted"),
        "best_acc_unweighted": _num(table["acc_mean"].max()),
        "last5_acc_unweighted": _num(last["acc_mean"].mean()),
        "last10_acc_unweighted": _num(last_long["acc_mean"].mean()),
        "prev10_acc": _num(before_long["acc_weighted"].mean()),
        "prev10_acc_unweighted": _num(before_long["acc_mean"].mean()),
        "final_acc_unweighted": at_final("acc_mean"),
        "final_acc_std": at_final("acc_std"),
        "final_acc_worst": at_final("acc_worst"),
        "final_balanced_acc": at_final("balanced_acc"),
    }


def _num(value) -> float | None:
    value = float(value)
    return None if np.isnan(value) else value
