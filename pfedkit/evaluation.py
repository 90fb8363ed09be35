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
              eval_point: str = "after_download") -> dict:
    """The run's summary.json content: every number, and `headline_acc`, the one chosen by
    (`weighting`, `point`) with `headline` saying in words which it is."""
    table = round_table(metrics)
    last = table.tail(LAST_K)
    last_long = table.tail(LAST_K_LONG)
    best_round = int(table["acc_weighted"].idxmax()) if len(table) else None
    final = table.iloc[-1] if len(table) else None
    summary = {
        "algorithm": algorithm,
        "dataset": dataset,
        "rounds": rounds,
        "rounds_done": int(metrics["round"].max()) if len(metrics) else 0,
        "best_round": best_round,
        "best_acc": _num(table["acc_weighted"].max()),
        "last5_acc": _num(last["acc_weighted"].mean()),
        "last10_acc": _num(last_long["acc_weighted"].mean()),
        "final_acc": _num(final["acc_weighted"]) if final is not None else None,
        "best_acc_unweighted": _num(table["acc_mean"].max()),
        "last5_acc_unweighted": _num(last["acc_mean"].mean()),
        "last10_acc_unweighted": _num(last_long["acc_mean"].mean()),
        "final_acc_unweighted": _num(final["acc_mean"]) if final is not None else None,
        "final_acc_std": _num(final["acc_std"]) if final is not None else None,
        "final_acc_worst": _num(final["acc_worst"]) if final is not None else None,
        "final_balanced_acc": _num(final["balanced_acc"]) if final is not None else None,
        "bytes_up": int(metrics["bytes_up"].sum()),
        "bytes_down": int(metrics["bytes_down"].sum()),
        # one-off setup exchange (round 0), included in bytes_up; settings.md §4.6 reports it apart
        "bytes_setup": int(metrics.loc[metrics["round"] == 0, "bytes_up"].sum()),
    }
    key = ("final_acc" if point == "final" else f"{point}_acc") + ("_unweighted" if weighting == "unweighted" else "")
    summary["headline_acc"] = summary[key]
    summary["headline"] = f"{HEADLINE_WORDS[weighting]}, {HEADLINE_WORDS[point]}; evaluated {eval_point.replace('_', ' ')}"
    if class_correct is not None and class_total is not None:
        summary["final_group_acc"] = group_accuracy(class_correct, class_total, train_counts)
    return summary


def _num(value) -> float | None:
    value = float(value)
    return None if np.isnan(value) else value
