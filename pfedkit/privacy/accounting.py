"""epsilon from maintained accountants, and the run's privacy budget.

Client level: one Gaussian mechanism per round. How the round's clients are drawn decides the analysis:
- fixed-size sampling (`participants=round|floor`: m of the N training clients, without
  replacement): Google's dp_accounting RDP analysis of sampling without replacement (Wang, Balle,
  Kasiviswanathan, AISTATS 2019), exact for this sampling. Its neighbouring relation is REPLACE-ONE
  (N is public; one client's data is swapped for anyone else's). Swapping one clipped update for
  another moves the sum by up to 2C (two updates of norm <= C pointing opposite ways), so the
  mechanism's noise / sensitivity ratio is z C / 2C = z / 2, and that is what is accounted.
- Poisson sampling (`participants=poisson`, each client joins with probability q = join_ratio):
  Opacus' RDP or PRV accountant (`dp.accountant`), add/remove-one adjacency, sensitivity C / (q N)
  against noise z C / (q N): ratio z.
Sample level: each client's own DP-SGD, one mechanism per local step with rate q_i = batch_size /
n_i, counted over the steps the client actually ran (metrics.csv `train_steps`); the run reports the
worst client's epsilon. Opacus' Poisson analysis of that rate; local training walks shuffled
fixed-size batches, so this one stays an approximation (documented in docs/privacy.md).
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

ACCOUNTANTS = ("rdp", "prv")
INSTALL_HINT = "pip install 'pfedkit[dp]'"


def epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "rdp") -> float:
    """The epsilon of `steps` compositions of the subsampled Gaussian mechanism (noise std /
    sensitivity = `noise_multiplier`, rate `sample_rate`) at `delta`: 0 before any step, inf without noise."""
    if steps <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    return epsilon_of_history([(noise_multiplier, sample_rate, int(steps))], delta, accountant)


def epsilon_of_history(history: Sequence[tuple[float, float, int]], delta: float, accountant: str = "rdp") -> float:
    """epsilon of a sequence of (noise_multiplier, sample_rate, steps) mechanisms, by Opacus."""
    from opacus.accountants import PRVAccountant, RDPAccountant

    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
    history = [(float(z), float(q), int(k)) for z, q, k in history if k > 0]
    if not history:
        return 0.0
    if any(z <= 0 for z, _, _ in history):
        return math.inf
    acc = RDPAccountant() if accountant == "rdp" else PRVAccountant()
    acc.history = history
    with warnings.catch_warnings():  # Opacus' hints about its grid of orders / numerical domain
        warnings.simplefilter("ignore")
        return float(acc.get_epsilon(delta))


def epsilon_without_replacement(noise_multiplier: float, population: int, sampled: int, steps: int,
                                delta: float) -> float:
    """The epsilon of `steps` compositions of the Gaussian mechanism run on `sampled` of `population`
    records drawn uniformly without replacement, at `delta`, under replace-one adjacency, by
    dp_accounting's RDP accountant. `noise_multiplier`: noise std / the L2 sensitivity under
    replace-one (for a sum of updates clipped to C that sensitivity is 2C)."""
    if steps <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    try:
        import dp_accounting
    except ImportError:
        raise ImportError(f"client-level DP accounting needs the dp-accounting package: {INSTALL_HINT}") from None
    accountant = dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    event = dp_accounting.SampledWithoutReplacementDpEvent(
        int(population), int(sampled), dp_accounting.GaussianDpEvent(float(noise_multiplier)))
    accountant.compose(event, int(steps))
    return float(accountant.get_epsilon(delta))


class PrivacyBudget:
    """The run's epsilon round by round, read from the metrics rows (so a resumed run recounts
    exactly), and whether the next round would exceed `target_epsilon`.

    level "client", `client_sampling` "fixed": epsilon_without_replacement(z / 2, N, m, rounds done);
    "poisson": epsilon(z, q = join_ratio, rounds done). level "sample": max over clients of
    epsilon(z_s, min(1, B / n_i), DP-SGD steps client i ran); before a round, each of its
    participants is expected to run as many steps as in its previous participation (its first:
    local_steps, or local_epochs passes over its data in batches of B): exact for methods whose
    local work is the same every round, and checked after the round (`overshoot`: a round that
    ran more steps than predicted and passed the target is reported, and the summary says
    `dp_target_exceeded`)."""

    def __init__(self, level: str, noise_multiplier: float, delta: float, accountant: str,
                 target_epsilon: float | None, participants: Callable[[int], list[int]], num_clients: int,
                 n_train: Sequence[int] = (), batch_size: int = 1, local_epochs: int = 1, drop_last: bool = False,
                 client_sampling: str = "fixed", join_ratio: float = 1.0, local_steps: int | None = None) -> None:
        if level not in ("client", "sample"):
            raise ValueError(f"level must be 'client' or 'sample', got {level!r}")
        if client_sampling not in ("fixed", "poisson"):
            raise ValueError(f"client_sampling must be 'fixed' or 'poisson', got {client_sampling!r}")
        self.client_sampling, self.join_ratio = client_sampling, join_ratio
        self.level, self.noise_multiplier, self.delta, self.accountant = level, noise_multiplier, delta, accountant
        # participants(rnd): the clients sampled in round rnd (the engine's seeded draw);
        # num_clients: how many clients that draw picks from (N, less the new clients kept out)
        self.target_epsilon, self.participants, self.num_clients = target_epsilon, participants, num_clients
        # fixed-size: m, the same every round; Poisson: the count varies (its mean is q N)
        self.sampled = len(participants(1)) if client_sampling == "fixed" else None
        self.n_train, self.batch_size = list(n_train), batch_size
        self.local_epochs, self.drop_last, self.local_steps = local_epochs, drop_last, local_steps
        self._cache: dict[tuple[float, int], float] = {}

    @property
    def client_rate(self) -> float:
        """q: the chance a given client is in a round's sample (m / N, or join_ratio under Poisson)."""
        return self.join_ratio if self.sampled is None else self.sampled / self.num_clients

    @property
    def adjacency(self) -> str:
        """The neighbouring relation the reported epsilon is for."""
        return "replace-one" if self.level == "client" and self.client_sampling == "fixed" else "add-remove-one"

    def _client_epsilon(self, rounds: int) -> float:
        key = (-1.0, rounds)
        if key not in self._cache:
            if self.client_sampling == "fixed":  # replace-one sensitivity 2C against noise z C: ratio z / 2
                self._cache[key] = epsilon_without_replacement(self.noise_multiplier / 2, self.num_clients,
                                                               self.sampled, rounds, self.delta)
            else:
                self._cache[key] = epsilon(self.noise_multiplier, self.join_ratio, rounds, self.delta, self.accountant)
        return self._cache[key]

    def sample_rate(self, cid: int) -> float:
        """q_i = B / n_i: the chance a given sample of client cid is in one of its mini-batches."""
        return min(1.0, self.batch_size / max(1, self.n_train[cid]))

    def _epsilon(self, rate: float, steps: int) -> float:
        key = (rate, steps)
        if key not in self._cache:
            self._cache[key] = epsilon(self.noise_multiplier, rate, steps, self.delta, self.accountant)
        return self._cache[key]

    def client_steps(self, rows: Sequence[dict], up_to: int) -> dict[int, int]:
        """DP-SGD steps per client in rounds 1..up_to (the rows' `train_steps`)."""
        steps: dict[int, int] = {}
        for row in rows:
            if 1 <= row["round"] <= up_to and row["train_steps"]:
                steps[row["client"]] = steps.get(row["client"], 0) + int(row["train_steps"])
        return steps

    def epsilon_after(self, rows: Sequence[dict], rnd: int) -> float:
        """The run's epsilon once round `rnd` is done."""
        if self.level == "client":
            return self._client_epsilon(rnd)
        steps = self.client_steps(rows, rnd)
        return max((self._epsilon(self.sample_rate(cid), k) for cid, k in steps.items()), default=0.0)

    def expected_steps(self, rows: Sequence[dict], cid: int) -> int:
        """Sample level: the DP-SGD steps client cid is expected to run when it next takes part."""
        for row in reversed(rows):
            if row["client"] == cid and row["round"] >= 1 and row["train_steps"]:
                return int(row["train_steps"])
        n, b = self.n_train[cid], self.batch_size
        per_pass = n // b if self.drop_last else math.ceil(n / b)
        if self.local_steps is not None:  # config local_steps: that many, unless no batch fits at all
            return self.local_steps if per_pass else 0
        return self.local_epochs * per_pass

    def epsilon_next(self, rows: Sequence[dict], done: int, participants: Sequence[int]) -> float:
        """The run's epsilon if round done + 1 runs with these participants."""
        if self.level == "client":
            return self._client_epsilon(done + 1)
        steps = self.client_steps(rows, done)
        for cid in participants:
            steps[cid] = steps.get(cid, 0) + self.expected_steps(rows, cid)
        return max((self._epsilon(self.sample_rate(cid), k) for cid, k in steps.items()), default=0.0)

    def exhausted(self, rows: Sequence[dict], done: int, participants: Sequence[int]) -> str | None:
        """One line saying why round done + 1 must not run (it would exceed target_epsilon), or None."""
        if self.target_epsilon is None:
            return None
        upcoming = self.epsilon_next(rows, done, participants)
        if upcoming <= self.target_epsilon:
            return None
        kept = f"rounds 1-{done} are kept (epsilon {self.epsilon_after(rows, done):.4g})" if done else "no round ran"
        return (f"dp.target_epsilon: stopped after round {done}: round {done + 1} would reach epsilon "
                f"{upcoming:.4g} > {self.target_epsilon:g} (delta {self.delta:g}); {kept}")

    def overshoot(self, rows: Sequence[dict], rnd: int) -> str | None:
        """One line if round rnd, now done, took the run past target_epsilon (at sample level a
        participant may run more DP-SGD steps than its previous participation predicted), or None."""
        if self.target_epsilon is None or (reached := self.epsilon_after(rows, rnd)) <= self.target_epsilon:
            return None
        return (f"dp.target_epsilon: round {rnd} ran more DP-SGD steps than predicted and reached epsilon "
                f"{reached:.4g} > {self.target_epsilon:g} (delta {self.delta:g}); the run stops here and its "
                "summary says dp_target_exceeded")

    def write_epsilon(self, rows: list[dict], rnd: int) -> None:
        """metrics.csv's `epsilon` column: the run's epsilon after round rnd, on that round's rows."""
        value = self.epsilon_after(rows, rnd)
        for row in rows:
            if row["round"] == rnd:
                row["epsilon"] = value

    def summary(self, rows: Sequence[dict], done: int, planned: int) -> dict:
        """The summary's privacy fields: the guarantee of the rounds done."""
        rate = self.client_rate if self.level == "client" else None
        reached = self.epsilon_after(rows, done)
        exceeded = self.target_epsilon is not None and reached > self.target_epsilon
        return {"dp_level": self.level, "epsilon": reached, "delta": self.delta,
                "dp_accountant": self.accountant, "dp_noise_multiplier": self.noise_multiplier,
                "dp_client_sampling_rate": rate,
                "dp_client_sampling": self.client_sampling if self.level == "client" else None,
                "dp_adjacency": self.adjacency, "dp_target_epsilon": self.target_epsilon,
                "dp_stopped_early": done < planned, "dp_target_exceeded": exceeded}
