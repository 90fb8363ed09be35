"""Split a labelled pool into per-client index sets (specs/settings.md §1).

Each scheme is one small function ``_<scheme>(pool, num_clients, rng, *, <its parameters>)`` that
returns one index array per client; :func:`partition` validates the shared inputs, checks the
keyword parameters against that function's signature (so a misspelt parameter fails loudly instead
of silently taking its default) and dispatches through ``_SCHEMES``.

Rules shared by all schemes (settings.md, "General rules"):
* randomness only from ``default_rng(SeedSequence([seed, crc32("partition")]))``, never from
  global state;
* classes are found by label (``_Pool.by_class``), never by fixed offsets, so unequal class sizes
  (MNIST's) are handled;
* sampling within a class is without replacement and clients are disjoint; when a requirement cannot
  be met a :class:`PartitionError` says what was wrong, what is allowed and how to fix it.

"Class k" below means the k-th smallest distinct label of the pool, which is label k whenever the
labels are 0..K-1. Outputs are sorted int64 arrays of positions into ``labels``.
"""

from __future__ import annotations

import inspect
import math
import warnings
import zlib
from dataclasses import dataclass

import numpy as np

__all__ = [
    "PartitionError",
    "SCHEMES",
    "partition",
    "split_train_test",
    "test_from_official",
    "class_counts",
]

# PFLlib's constants behind the default minimum client size (§1.2 step 1, §1.3 step 1).
_PFLLIB_BATCH = 10
_PFLLIB_TRAIN_RATIO = 0.75
# group_dominant always uses five label groups (§1.6 step 1-2).
_NUM_GROUPS = 5
# Slack for floor/round of float products: 0.29 * 100 is 28.999999999999996 in floating point.
_EPS = 1e-9


class PartitionError(ValueError):
    """A partition request that cannot be met; the message says what to change."""


# ---------------------------------------------------------------------------------------------
# Shared helpers


def _purpose_key(purpose: str) -> int:
    """Stable integer for a purpose name (CRC-32: ``hash()`` of a str is salted per process)."""
    return zlib.crc32(purpose.encode("utf-8"))


def _rng(seed: int, *keys: int | str) -> np.random.Generator:
    """Generator seeded by (seed, *keys); string keys are purpose names (design.md property 5)."""
    entropy = [_check_int("seed", seed, low=0, fix="Use a non-negative integer seed.")]
    entropy += [_purpose_key(key) if isinstance(key, str) else int(key) for key in keys]
    return np.random.default_rng(np.random.SeedSequence(entropy))


def _check_int(name: str, value, low: int, high: int | None = None, fix: str = "") -> int:
    """Return ``value`` as int if it is an integer in [low, high]; else raise naming ``name``."""
    is_int = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    if not is_int or value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise PartitionError(f"{name} must be an integer {allowed} (got {value!r}). {fix}".rstrip())
    return int(value)


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _check_positive(name: str, value, fix: str) -> float:
    """Return ``value`` as float if it is a finite number > 0; else raise naming ``name``."""
    if not _is_number(value):
        raise PartitionError(f"{name} must be a number > 0 (got {value!r}). {fix}")
    if not (math.isfinite(value) and value > 0):
        raise PartitionError(f"{name} must be a finite number > 0 (got {value!r}). {fix}")
    return float(value)


def _floor(x: float) -> int:
    """⌊x⌋ that is not fooled by products like 0.29*100 = 28.999999999999996."""
    return math.floor(x + _EPS)


def _round_half_up(x: float) -> int:
    """round_half_up(x) = ⌊x + 1/2⌋ (§1.8, §1.9); Python's round() would round halves to even."""
    return math.floor(x + 0.5 + _EPS)


def _default_least(pool_size: int, num_clients: int) -> int:
    """§1.3 step 1: least = ⌊min(B_gen/(1 − r_train), |pool|/(2N))⌋, normally 40 (PFLlib)."""
    return math.floor(min(_PFLLIB_BATCH / (1 - _PFLLIB_TRAIN_RATIO), pool_size / (2 * num_clients)))


def _split_counts(total: int, parts: int) -> np.ndarray:
    """⌊total/parts⌋ for each part, the last takes the remainder (§1.6 steps 3-4)."""
    counts = np.full(parts, total // parts, dtype=np.int64)
    counts[-1] += total - counts.sum()
    return counts


def _largest_remainder(shares: np.ndarray, total: int) -> np.ndarray:
    """Integer counts ≈ shares·total that sum exactly to ``total`` (largest-remainder rounding)."""
    exact = shares / shares.sum() * total
    counts = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    counts[np.argsort(counts - exact, kind="stable")[:short]] += 1  # largest fractional parts first
    return counts


@dataclass(frozen=True)
class _Pool:
    """The labels being partitioned and, per class, the positions holding that class."""

    labels: np.ndarray
    classes: np.ndarray  # distinct labels, ascending
    by_class: tuple[np.ndarray, ...]  # by_class[k]: ascending positions of class k
    writers: np.ndarray | None = None  # each sample's writer id (FEMNIST), for the natural scheme

    @classmethod
    def of(cls, labels, writers=None) -> _Pool:
        labels = np.asarray(labels)
        if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
            raise PartitionError(
                f"labels must be a 1-D integer array (got shape {labels.shape}, "
                f"dtype {labels.dtype}); "
                "pass the class label of every sample in the pool, e.g. dataset.targets as int64."
            )
        if labels.size == 0:
            raise PartitionError("labels is empty: there is nothing to partition; "
                                 "pass the pool's labels.")
        classes, inverse = np.unique(labels, return_inverse=True)
        order = np.argsort(inverse, kind="stable")
        by_class = np.split(order, np.cumsum(np.bincount(inverse, minlength=len(classes)))[:-1])
        if writers is not None:
            writers = np.asarray(writers)
            if writers.shape != labels.shape:
                raise PartitionError(f"writers must give one writer id per label (got shape {writers.shape} "
                                     f"for {labels.shape} labels).")
        return cls(labels, classes, tuple(members.astype(np.int64) for members in by_class), writers)

    @property
    def size(self) -> int:
        return len(self.labels)

    @property
    def num_classes(self) -> int:
        return len(self.classes)


class _Draws:
    """Per-class shuffled queues consumed front to back: no replacement, disjoint across clients."""

    def __init__(self, pool: _Pool, rng: np.random.Generator, fix: str):
        self._pool = pool
        self._queues = [rng.permutation(members) for members in pool.by_class]
        self._used = np.zeros(pool.num_classes, dtype=np.int64)
        self._fix = fix

    def left(self) -> np.ndarray:
        return np.array([len(q) for q in self._queues], dtype=np.int64) - self._used

    def take(self, k: int, count: int) -> np.ndarray:
        start = self._used[k]
        if start + count > len(self._queues[k]):
            raise PartitionError(
                f"not enough samples of class {self._pool.classes[k]}: {count} more needed but "
                f"only {len(self._queues[k]) - start} of {len(self._queues[k])} left. {self._fix}"
            )
        self._used[k] += count
        return self._queues[k][start : start + count]


def _concat(chunks: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(chunks) if chunks else np.empty(0, dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# Schemes (one function each; keyword-only parameters are the scheme's public parameters)


def _iid(pool: _Pool, num_clients: int, rng, *, samples_per_client: int | None = None):
    """§1.1: shuffle, then N parts whose sizes differ by ≤ 1, or N parts of samples_per_client."""
    order = rng.permutation(pool.size)
    if samples_per_client is None:
        return np.array_split(order, num_clients)
    size = _check_int("samples_per_client", samples_per_client, low=1,
                      fix="Use None to split the whole pool.")
    if num_clients * size > pool.size:
        raise PartitionError(
            f"iid needs num_clients * samples_per_client = {num_clients * size} samples but the "
            f"pool has {pool.size}; lower samples_per_client to at most "
            f"{pool.size // num_clients} or use None to split the whole pool."
        )
    return np.split(order[: num_clients * size], num_clients)


def _dirichlet(pool: _Pool, num_clients: int, rng, *, alpha: float, least: int | None = None,
               max_tries: int = 1000):
    """§1.3 (PFLlib ``dir``): per-class Dir(α) shares, redrawn until every client has ≥ least."""
    alpha = _check_positive("alpha", alpha, fix="Smaller alpha gives more label skew (e.g. 0.1); "
                                                 "large alpha (e.g. 100) is near-IID.")
    if least is None:
        least = _default_least(pool.size, num_clients)
    least = _check_int("least", least, low=0, fix="It is the minimum number of samples per client.")
    max_tries = _check_int("max_tries", max_tries, low=1)
    if least * num_clients > pool.size:
        raise PartitionError(
            f"dirichlet cannot give each of {num_clients} clients least={least} samples from a "
            f"pool of {pool.size}; lower least to at most {pool.size // num_clients} or use fewer "
            "clients."
        )
    smallest = 0
    for _ in range(max_tries):
        parts = _dirichlet_once(pool, num_clients, rng, alpha)
        smallest = min(len(part) for part in parts)
        if smallest >= least:
            return parts
    raise PartitionError(
        f"dirichlet found no allocation with every client holding >= least={least} samples in "
        f"max_tries={max_tries} attempts (smallest client in the last attempt: {smallest}); raise "
        f"alpha (now {alpha}), lower num_clients (now {num_clients}) or lower least."
    )


def _dirichlet_once(pool: _Pool, num_clients: int, rng, alpha: float) -> list[np.ndarray]:
    """One attempt of §1.3 step 2."""
    average = pool.size / num_clients
    sizes = np.zeros(num_clients, dtype=np.int64)
    chunks: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for members in pool.by_class:
        members = rng.permutation(members)
        shares = rng.dirichlet(np.full(num_clients, alpha))
        # Clients already at or above the average size get no more: this caps client sizes.
        capped = np.where(sizes >= average, 0.0, shares)
        if capped.sum() > 0:  # all capped: keep the unmasked shares [ours]
            shares = capped / capped.sum()
        cuts = (np.cumsum(shares) * len(members)).astype(np.int64)[:-1]
        for client, chunk in enumerate(np.split(members, cuts)):
            chunks[client].append(chunk)
            sizes[client] += len(chunk)
    return [_concat(c) for c in chunks]


def _dirichlet_client(pool: _Pool, num_clients: int, rng, *, alpha: float,
                      samples_per_client: int | None = None):
    """§1.4: per client q ~ Dir(α·1_K), largest-remainder class counts of the client's size."""
    alpha = _check_positive("alpha", alpha, fix="Smaller alpha gives more label skew (e.g. 0.1).")
    size = pool.size // num_clients if samples_per_client is None else samples_per_client
    size = _check_int("samples_per_client", size, low=1, fix="Use None for |pool| / num_clients.")
    if num_clients * size > pool.size:
        raise PartitionError(
            f"dirichlet_client needs num_clients * samples_per_client = {num_clients * size} "
            f"samples but the pool has {pool.size}; lower samples_per_client to at most "
            f"{pool.size // num_clients}."
        )
    draws = _Draws(pool, rng, fix="Lower samples_per_client.")
    parts = []
    for _ in range(num_clients):
        shares = rng.dirichlet(np.full(pool.num_classes, alpha))
        counts = _client_class_counts(shares, size, draws.left())
        parts.append(_concat([draws.take(k, int(c)) for k, c in enumerate(counts)]))
    return parts


def _client_class_counts(shares: np.ndarray, size: int, left: np.ndarray) -> np.ndarray:
    """Class counts for one client of §1.4; what an exhausted class cannot give goes to the classes
    that still have samples, in proportion to ``shares`` [ours]. Needs left.sum() >= size."""
    counts = np.minimum(_largest_remainder(shares, size), left)
    while (missing := size - int(counts.sum())) > 0:
        spare = left - counts
        weights = np.where(spare > 0, shares, 0.0)
        if weights.sum() == 0:  # the client's shares are all on exhausted classes: spread evenly
            weights = (spare > 0).astype(float)
        counts += np.minimum(_largest_remainder(weights, missing), spare)
    return counts


def _pathological(pool: _Pool, num_clients: int, rng, *, classes_per_client: int,
                  balanced: bool = False):
    """§1.2 (PFLlib ``pat``): classes in order go to the first ⌈N·C/K⌉ clients with free slots."""
    num_classes = pool.num_classes
    per_client = _check_int(
        "classes_per_client", classes_per_client, low=1, high=num_classes,
        fix=f"The pool has {num_classes} classes; choose between 1 and {num_classes}.",
    )
    least_share = _default_least(pool.size, num_clients) / num_classes
    clients_per_class = math.ceil(num_clients * per_client / num_classes)
    slots = np.full(num_clients, per_client)
    chunks: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for k, members in enumerate(pool.by_class):
        selected = np.flatnonzero(slots > 0)[:clients_per_class]
        if len(selected) == 0:  # all slots used: the remaining classes stay unused (§1.2 step 3)
            break
        counts = _pathological_counts(len(members), len(selected), least_share, balanced, rng,
                                      pool.classes[k])
        members = rng.permutation(members)  # [ours]; PFLlib keeps pool order
        for client, chunk in zip(selected, np.split(members, np.cumsum(counts)[:-1])):
            chunks[client].append(chunk)
        slots[selected] -= 1
    return [_concat(c) for c in chunks]


def _pathological_counts(class_size: int, num_selected: int, least_share: float, balanced: bool,
                         rng, label) -> np.ndarray:
    """§1.2 step 3: one class's chunk sizes; all but the last fixed or drawn, the last the rest."""
    if class_size < num_selected:
        raise PartitionError(
            f"not enough samples of class {label}: {class_size} samples must be shared by "
            f"{num_selected} clients; use fewer clients or a smaller classes_per_client."
        )
    per = class_size / num_selected
    if balanced:
        head = np.full(num_selected - 1, math.floor(per), dtype=np.int64)
    elif num_selected == 1:
        head = np.zeros(0, dtype=np.int64)
    else:
        # The papers' "different numbers of samples": uniform in [⌊max(per/10, least/K)⌋, ⌊per⌋).
        low, high = math.floor(max(per / 10, least_share)), math.floor(per)
        if low >= high:
            raise PartitionError(
                f"not enough samples of class {label} for unbalanced sizes: {class_size} samples "
                f"over {num_selected} clients leaves an empty range [{low}, {high}) for the "
                "per-client draw; use balanced=True, fewer clients or a smaller classes_per_client."
            )
        head = rng.integers(low, high, size=num_selected - 1)
    return np.append(head, class_size - head.sum())


def _shards(pool: _Pool, num_clients: int, rng, *, shards_per_client: int = 2):
    """§1.5 (McMahan et al.): sort by label, cut N·S shards, give each client S random shards.

    When N·S does not divide |pool| the shard sizes differ by one, so the whole pool is covered and
    client sizes differ by at most S [ours]."""
    per_client = _check_int("shards_per_client", shards_per_client, low=1)
    num_shards = num_clients * per_client
    if num_shards > pool.size:
        raise PartitionError(
            f"shards needs num_clients * shards_per_client = {num_shards} shards but the pool has "
            f"only {pool.size} samples; lower shards_per_client or num_clients."
        )
    shards = np.array_split(np.argsort(pool.labels, kind="stable"), num_shards)
    owners = rng.permutation(num_shards).reshape(num_clients, per_client)
    return [_concat([shards[s] for s in row]) for row in owners]


def _group_labels(group: int, num_classes: int) -> list[int]:
    """§1.6 step 1: G_g = {(2g + j) mod K : j = 0, 1, 2}; neighbouring groups share one label."""
    return [(2 * group + j) % num_classes for j in range(3)]


def _group_dominant(pool: _Pool, num_clients: int, rng, *, s: float = 0.2,
                    samples_per_client: int = 600):
    """§1.6 (FedReMa / FedPAC "by_s"): IID share s spread over all classes, the rest over the
    client's group of three labels; client c is in group ⌊c·5/N⌋."""
    num_classes = pool.num_classes
    if num_classes < 3:
        raise PartitionError(f"group_dominant needs at least 3 classes (got {num_classes}): "
                             "each group has three labels.")
    if not _is_number(s) or not 0 <= s <= 1:
        raise PartitionError(f"s must be a number in [0, 1] (got {s!r}); it is the IID share of "
                             "each client's samples: 0 = only the group's labels, 1 = IID.")
    size = _check_int("samples_per_client", samples_per_client, low=1)
    iid_size = _floor(size * s)
    base_counts = _split_counts(iid_size, num_classes)
    dominant_counts = _split_counts(size - iid_size, 3)
    draws = _Draws(pool, rng, fix="Lower samples_per_client or num_clients, or raise s.")
    parts = []
    for client in range(num_clients):
        counts = base_counts.copy()
        counts[_group_labels(client * _NUM_GROUPS // num_clients, num_classes)] += dominant_counts
        parts.append(_concat([draws.take(k, int(c)) for k, c in enumerate(counts)]))
    return parts


def _nway_kshot(pool: _Pool, num_clients: int, rng, *, n: int = 3, k: int = 100,
                n_noise: int = 1, k_noise: int = 1):
    """§1.7 steps 1-4 (FedProto / pFedPM): n_i random classes, k_i samples of each."""
    num_classes = pool.num_classes
    n, k = _check_int("n", n, low=1), _check_int("k", k, low=1)
    n_noise, k_noise = _check_int("n_noise", n_noise, low=0), _check_int("k_noise", k_noise, low=0)
    ways_low, ways_high = max(2, n - n_noise), min(num_classes - 1, n + n_noise)
    if ways_low > ways_high:
        raise PartitionError(
            f"nway_kshot ways range [max(2, n - n_noise), min(C - 1, n + n_noise)] = [{ways_low}, "
            f"{ways_high}] is empty for n={n}, n_noise={n_noise} and C={num_classes} classes; "
            "choose n (and n_noise) so that n + n_noise >= 2 and n - n_noise <= C - 1 (C >= 3)."
        )
    shots_low, shots_high = k - k_noise + 1, k + k_noise
    if not 1 <= shots_low <= shots_high:
        raise PartitionError(
            f"nway_kshot shots range [k - k_noise + 1, k + k_noise] = [{shots_low}, {shots_high}] "
            f"is empty or below 1 for k={k}, k_noise={k_noise}; use 1 <= k_noise <= k."
        )
    ways = rng.integers(ways_low, ways_high + 1, size=num_clients)
    shots = rng.integers(shots_low, shots_high + 1, size=num_clients)
    draws = _Draws(pool, rng, fix="Lower k, n or num_clients.")
    parts = []
    for client in range(num_clients):
        chosen = rng.choice(num_classes, size=ways[client], replace=False)
        parts.append(_concat([draws.take(c, int(shots[client])) for c in chosen]))
    return parts


def _natural(pool: _Pool, num_clients: int, rng):
    """One client per writer (LEAF's natural FEMNIST split): client i holds every sample of the
    i-th writer. With fewer clients than writers, ``num_clients`` writers drawn uniformly without
    replacement, clients in ascending writer order [ours]; all writers: no draw."""
    if pool.writers is None:
        raise PartitionError("partition scheme 'natural' needs writer ids, and this dataset has none; "
                             "use a dataset with writers (femnist, femnist_lower10) or another scheme.")
    writers, inverse = np.unique(pool.writers, return_inverse=True)
    if num_clients > len(writers):
        raise PartitionError(f"natural: num_clients={num_clients} but the pool has {len(writers)} writers; "
                             f"allowed num_clients: 1..{len(writers)} ({len(writers)} = one client per writer).")
    chosen = np.arange(len(writers)) if num_clients == len(writers) else \
        np.sort(rng.choice(len(writers), size=num_clients, replace=False))
    order = np.argsort(inverse, kind="stable")
    by_writer = np.split(order, np.cumsum(np.bincount(inverse, minlength=len(writers)))[:-1])
    return [by_writer[w] for w in chosen]


_SCHEMES = {
    "iid": _iid,
    "dirichlet": _dirichlet,
    "dirichlet_client": _dirichlet_client,
    "pathological": _pathological,
    "shards": _shards,
    "group_dominant": _group_dominant,
    "nway_kshot": _nway_kshot,
    "natural": _natural,
}
SCHEMES: tuple[str, ...] = tuple(_SCHEMES)


def _scheme_parameters(scheme: str) -> dict[str, object]:
    """Keyword-only parameters of a scheme and their defaults (``Parameter.empty``: required)."""
    signature = inspect.signature(_SCHEMES[scheme])
    return {name: p.default for name, p in signature.parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _check_scheme_params(scheme: str, params: dict) -> None:
    accepted = _scheme_parameters(scheme)
    described = ", ".join(name if default is inspect.Parameter.empty else f"{name}={default!r}"
                          for name, default in accepted.items())
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise PartitionError(f"unknown parameter(s) {', '.join(unknown)} for scheme {scheme!r}; "
                             f"it accepts: {described}. Check the spelling.")
    missing = [name for name, default in accepted.items()
               if default is inspect.Parameter.empty and name not in params]
    if missing:
        raise PartitionError(f"scheme {scheme!r} needs parameter(s) {', '.join(missing)}; "
                             f"it accepts: {described}.")


# ---------------------------------------------------------------------------------------------
# Public API


def partition(labels: np.ndarray, scheme: str, num_clients: int, seed: int,
              writers: np.ndarray | None = None, **params) -> list[np.ndarray]:
    """Disjoint index arrays (int64, sorted ascending) into `labels`, one per client (§1.1-§1.7).

    ``params`` are the scheme's keyword parameters (see ``_<scheme>`` in this module):
    iid(samples_per_client=None), dirichlet(alpha, least=None, max_tries=1000),
    dirichlet_client(alpha, samples_per_client=None), pathological(classes_per_client,
    balanced=False), shards(shards_per_client=2), group_dominant(s=0.2, samples_per_client=600),
    nway_kshot(n=3, k=100, n_noise=1, k_noise=1), natural() (needs ``writers``: each sample's
    writer id; other schemes ignore it).
    """
    if scheme not in _SCHEMES:
        raise PartitionError(f"unknown partition scheme {scheme!r}; "
                             f"choose one of: {', '.join(SCHEMES)}.")
    pool = _Pool.of(labels, writers)
    num_clients = _check_int(
        "num_clients", num_clients, low=1, high=pool.size,
        fix=f"Every client needs at least one of the pool's {pool.size} samples.",
    )
    _check_scheme_params(scheme, params)
    rng = _rng(seed, "partition")
    parts = _SCHEMES[scheme](pool, num_clients, rng, **params)
    return [np.sort(np.asarray(part, dtype=np.int64)) for part in parts]


def split_train_test(indices: np.ndarray, labels: np.ndarray, train_ratio: float, seed: int,
                     client: int, stratified: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """One client's train/test split with the same label distribution (§1.9). Returns (train, test).

    Stratified [ours, default]: for each class with m_c samples, round_half_up((1 − r)·m_c) go to
    test (0 if m_c = 1), the rest to train. ``stratified=False`` is a plain shuffled split like
    sklearn's ``train_test_split(train_size=r)`` (PFLlib): ⌊r·m⌋ train, the rest test.
    ``labels`` is indexed by the values in ``indices``; randomness from (seed, client, "split").
    """
    if not _is_number(train_ratio) or not 0 < train_ratio <= 1:
        raise PartitionError(f"train_ratio must be a number in (0, 1] (got {train_ratio!r}); "
                             "e.g. 0.75 (PFLlib) or 0.8 (FedReMa).")
    client = _check_int("client", client, low=0)
    indices = np.asarray(indices, dtype=np.int64)
    rng = _rng(seed, client, "split")
    if not stratified:
        order = rng.permutation(indices)
        num_test = len(order) - _floor(train_ratio * len(order))
        return np.sort(order[num_test:]), np.sort(order[:num_test])
    own_labels = np.asarray(labels)[indices]
    train, test = [], []
    for label in np.unique(own_labels):
        members = rng.permutation(indices[own_labels == label])
        num_test = 0 if len(members) == 1 else _round_half_up((1 - train_ratio) * len(members))
        test.append(members[:num_test])
        train.append(members[num_test:])
    return np.sort(_concat(train)), np.sort(_concat(test))


class _ReusableQueue:
    """One class's official test images in shuffled order; a new shuffled pass starts (reuse) only
    when the pool is exhausted [ours]."""

    def __init__(self, members: np.ndarray, rng: np.random.Generator):
        self.members, self._rng = members, rng
        self._order, self._next = rng.permutation(members), 0
        self.reused = False

    def take(self, count: int) -> np.ndarray:
        fresh = self._order[self._next : self._next + count]
        self._next += len(fresh)
        if len(fresh) == count:
            return fresh
        self.reused = True
        # Next pass: the images just handed out go last, so this client gets no duplicates.
        rest = self._rng.permutation(np.setdiff1d(self.members, fresh))
        self._order, self._next = np.concatenate([rest, fresh]), count - len(fresh)
        return np.concatenate([fresh, self._order[: self._next]])


def test_from_official(train_parts: list[np.ndarray], train_labels: np.ndarray,
                       test_labels: np.ndarray, seed: int, *, fraction: float | None = None,
                       shots: int | None = None) -> list[np.ndarray]:
    """Per-client test indices into ``test_labels`` (the official test split).

    For every class c of which the client has n_c > 0 training samples, take
    ``fraction``: round_half_up(fraction·n_c) images of class c (DA-PFL, §1.8), or
    ``shots``: ``shots`` images of class c (FedProto / pFedPM, §1.7 step 5).
    Without replacement and disjoint across clients while the class's test pool lasts; after that
    the pool is reused with a warning [ours]. Randomness from (seed, "official_test").
    """
    if (fraction is None) == (shots is None):
        raise PartitionError("test_from_official needs exactly one of fraction= (DA-PFL: e.g. "
                             "0.1 of each class's training count) or shots= (FedProto: e.g. 15 "
                             "per class).")
    if fraction is not None:
        fraction = _check_positive("fraction", fraction, fix="e.g. fraction=0.1 (DA-PFL).")
    else:
        shots = _check_int("shots", shots, low=1, fix="e.g. shots=15 (FedProto CIFAR-10).")
    train_labels, test_labels = np.asarray(train_labels), np.asarray(test_labels)
    rng = _rng(seed, "official_test")
    queues = {label: _ReusableQueue(np.flatnonzero(test_labels == label), rng)
              for label in np.unique(test_labels)}
    parts = []
    for client, part in enumerate(train_parts):
        own_classes, own_counts = np.unique(train_labels[np.asarray(part, dtype=np.int64)],
                                            return_counts=True)
        chunks = []
        for label, count in zip(own_classes, own_counts):
            wanted = shots if shots is not None else _round_half_up(fraction * count)
            available = len(queues[label].members) if label in queues else 0
            if wanted > available:
                raise PartitionError(
                    f"not enough test samples of class {label}: client {client} needs {wanted} but "
                    f"the official test split has {available}; lower "
                    f"{'shots' if shots is not None else 'fraction'}."
                )
            chunks.append(queues[label].take(wanted))
        parts.append(np.sort(_concat(chunks).astype(np.int64)))
    reused = [int(label) for label, queue in queues.items() if queue.reused]
    if reused:
        warnings.warn(f"official test pool exhausted for class(es) {reused}: test images of these "
                      "classes are shared between clients (within a client they stay distinct).",
                      stacklevel=2)
    return parts


# The name starts with "test": keep pytest from collecting it wherever a test module imports it.
test_from_official.__test__ = False


def class_counts(parts: list[np.ndarray], labels: np.ndarray, num_classes: int) -> np.ndarray:
    """[N, C] int64 matrix: entry (i, c) is how many samples of class c client i holds."""
    labels = np.asarray(labels)
    counts = np.zeros((len(parts), num_classes), dtype=np.int64)
    for client, part in enumerate(parts):
        own = labels[np.asarray(part, dtype=np.int64)]
        outside = own[(own < 0) | (own >= num_classes)]
        if outside.size:
            raise PartitionError(f"client {client} holds label {outside[0]} outside "
                                 f"[0, {num_classes}); pass the dataset's number of classes "
                                 "as num_classes.")
        counts[client] = np.bincount(own, minlength=num_classes)
    return counts


def stratified_subset(indices: np.ndarray, labels: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """A seeded class-stratified `fraction` of `indices` (labels[i] is the label of indices[i]):
    round(fraction * n_c) random members of every class c, returned in their original order.
    fraction = 1 returns `indices` unchanged."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if fraction == 1:
        return indices
    rng = _rng(seed, "pool-fraction")
    keep = np.zeros(len(indices), dtype=bool)
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        keep[rng.choice(members, size=int(round(fraction * len(members))), replace=False)] = True
    return indices[keep]
