"""A round's aggregation, fed one reply at a time (`Algorithm.start_aggregation`).

The engine hands each participant's reply to the aggregation as soon as its client update
returns and keeps no reference to it, so a server whose aggregate is a running sum holds one
model, not one per participant (1,000 FedAvg clients: 2.3 MB instead of 2.3 GB).

- `CollectReplies` (every algorithm's default): keeps the replies and calls `aggregate` on all of
  them at the end: exactly the batch aggregation.
- `SampleWeightedMean`: FedAvg's mean sum_i (n_i / sum_j n_j) w_i folded as replies come. The
  weights n_i are the participants' training-set sizes, which the server knows from the setup
  (`Setup.train_counts`); replies are folded in increasing client id, the order of the batch
  `weighted_mean`, holding only those that arrive before their turn. The result is the batch
  result bit for bit.
- `MeanOfUploads`: the Algorithm mixin of FedAvg and every method whose server keeps one part of
  the model as that mean (FedPer's shared part, FedBABU's body, FedRoD's body + generic head). The
  method names the server key (`averaged`); the mixin gives both of the contract's entry points,
  `aggregate` (batch) and `start_aggregation` (streamed), so the mean is declared once, and refuses
  a subclass that overrides either: being a `MeanOfUploads` is a capability others can rely on.
  Client-level DP does (`pfedkit.privacy`): it replaces exactly that mean, from outside the
  algorithm, by handing the round loop another `StartAggregation`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from pfedkit.core.params import Params, WeightedSum, mean_shares, weighted_mean

Message = dict[str, Any]


class Aggregation(Protocol):
    def add(self, cid: int, reply: Message) -> None:
        """Receive client `cid`'s reply (each participant at most once, in any order)."""

    def finish(self) -> Any:
        """The new server state, once every reply that will come has been added."""


# (rnd, server state, participants) -> the round's Aggregation: `Algorithm.start_aggregation`, or
# a policy the round loop is given from outside the algorithm (client-level DP's noised mean).
StartAggregation = Callable[[int, Any, list[int]], Aggregation]


class CollectReplies:
    """Keep every reply; `aggregate(replies)` at the end (replies in client order)."""

    def __init__(self, aggregate: Callable[[dict[int, Message]], Any]) -> None:
        self.aggregate = aggregate
        self.replies: dict[int, Message] = {}

    def add(self, cid: int, reply: Message) -> None:
        self.replies[cid] = reply

    def finish(self) -> Any:
        return self.aggregate(dict(sorted(self.replies.items())))


class SampleWeightedMean:
    """sum_i (n_i / sum_j n_j) reply_i[key] over the participants, as a running sum.

    `weights`: {cid: n_i} of the participants, known before training. Each reply must carry the
    same `weight`. `result(mean)` builds the server state; with no participants, `empty` is kept.
    A participant that never replies (a Flower node that dropped out) is left out: the sum over
    the others is rescaled by sum_all n / sum_received n."""

    def __init__(self, key: str, weights: dict[int, float], result: Callable[[Params], Any], empty: Any) -> None:
        self.key, self.result, self.empty = key, result, empty
        self.order = sorted(weights)
        self.weights = {cid: float(weights[cid]) for cid in self.order}
        self.shares = dict(zip(self.order, mean_shares(self.weights.values()))) if self.order else {}
        self.running = WeightedSum()
        self.waiting: dict[int, Params] = {}  # replies that came before their turn
        self.position = 0  # index in `order` of the next client to fold
        self.folded: list[int] = []

    def add(self, cid: int, reply: Message) -> None:
        if cid not in self.weights:
            raise KeyError(f"aggregation: client {cid} was not a participant of this round")
        if float(reply["weight"]) != self.weights[cid]:
            raise ValueError(f"aggregation: client {cid} replied with weight {reply['weight']}, "
                             f"expected its training-set size {self.weights[cid]:g}")
        self.waiting[cid] = reply[self.key]
        while self.position < len(self.order) and self.order[self.position] in self.waiting:
            self._fold(self.order[self.position])
            self.position += 1

    def finish(self) -> Any:
        for cid in self.order[self.position:]:
            if cid in self.waiting:  # behind a participant that never replied
                self._fold(cid)
        if not self.folded:
            return self.empty
        total = self.running.total
        received = sum(self.weights[cid] for cid in self.folded)
        expected = sum(self.weights.values())
        if received != expected:
            total = {name: value * (expected / received) for name, value in total.items()}
        return self.result(total)

    def _fold(self, cid: int) -> None:
        self.running.add(self.waiting.pop(cid), self.shares[cid])
        self.folded.append(cid)


def fedavg_aggregate(replies: dict[int, Message], key: str = "params") -> Params:
    """w = sum_i n_i w_i / sum_i n_i over the replies (each carries `key` and `weight` = n_i), in
    increasing client id (the order `SampleWeightedMean` folds in)."""
    ordered = sorted(replies)
    return weighted_mean([replies[c][key] for c in ordered], [replies[c]["weight"] for c in ordered])


class MeanOfUploads:
    """Mixin (before `Algorithm` in the bases) for a server whose state is {averaged: the n_i-weighted
    mean of the participants' uploaded "params"}, each reply carrying "params" and "weight" = n_i.

    A method states only WHICH server key holds the mean (`averaged`). A subclass that overrides
    `aggregate` or `start_aggregation` is refused when it is defined, so `isinstance(algorithm,
    MeanOfUploads)` means exactly "its server state is that mean": what client-level DP replaces
    (`pfedkit.privacy`). A method that aggregates otherwise subclasses `Algorithm` and writes its own."""
    averaged: ClassVar[str] = "params"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for hook in ("aggregate", "start_aggregation"):
            if getattr(cls, hook) is not getattr(MeanOfUploads, hook):  # resolved through the whole MRO
                raise TypeError(f"{cls.__qualname__} overrides {hook}, but a MeanOfUploads method's server state is "
                                "the n_i-weighted mean of its uploads, declared by the mixin alone (client-level DP "
                                "replaces exactly that mean); subclass Algorithm to aggregate otherwise")

    def aggregate(self, rnd: int, server: Any, replies: dict[int, Message]) -> Any:
        """The batch form: the mean of the replies; no replies keep the server state."""
        return {self.averaged: fedavg_aggregate(replies)} if replies else server

    def start_aggregation(self, rnd: int, server: Any, cids: list[int]) -> Aggregation:
        """The streamed form of `aggregate`: the n_i-weighted mean of the replies' "params" into
        `server[averaged]`, a running sum, bit for bit the batch result."""
        counts = self.setup.train_counts  # n_i: the participants' training-set sizes
        key = self.averaged
        return SampleWeightedMean("params", {cid: float(counts[cid].sum()) for cid in cids},
                                  lambda mean: {key: mean}, server)
