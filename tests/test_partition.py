"""Checkable properties of the partitioners (specs/settings.md §1.10) and their error messages."""

import warnings

import numpy as np
import pytest

from pfedkit.data.partition import (
    SCHEMES,
    PartitionError,
    class_counts,
    partition,
    split_train_test,
    test_from_official,
)
from pfedkit.data import partition as pfedkit_partition

# MNIST train + test merged: unequal class sizes, 70,000 samples.
MNIST_CLASS_SIZES = [6903, 7877, 6990, 7141, 6824, 6313, 6876, 7293, 6825, 6958]
# MNIST's official splits, scaled down 10x, for the official-test helpers.
TRAIN_CLASS_SIZES = [592, 674, 596, 613, 584, 542, 592, 627, 585, 595]
TEST_CLASS_SIZES = [98, 113, 103, 101, 98, 89, 96, 103, 97, 101]


def shuffled_labels(class_sizes, seed=0):
    labels = np.repeat(np.arange(len(class_sizes)), class_sizes)
    return np.random.default_rng(seed).permutation(labels)


@pytest.fixture(scope="module")
def labels():
    return shuffled_labels(MNIST_CLASS_SIZES)


def classes_of(parts, labels):
    return [set(np.unique(labels[p]).tolist()) for p in parts]


def assert_disjoint_in_range(parts, pool_size):
    for part in parts:
        assert part.dtype == np.int64
        assert np.all(np.diff(part) > 0), "sorted ascending, no duplicates"
        assert part.size == 0 or (part[0] >= 0 and part[-1] < pool_size)
    merged = np.concatenate(parts)
    assert len(np.unique(merged)) == len(merged), "clients overlap"


# Every scheme with parameters that fit the MNIST-sized pool and 20 clients.
SCHEME_CASES = {
    "iid": {},
    "dirichlet": {"alpha": 0.5},
    "dirichlet_client": {"alpha": 0.5},
    "pathological": {"classes_per_client": 2},
    "shards": {"shards_per_client": 2},
    "group_dominant": {"s": 0.2, "samples_per_client": 600},
    "nway_kshot": {"n": 3, "k": 100},
    "natural": {"writers": np.arange(sum(MNIST_CLASS_SIZES)) % 50},  # 50 writers, 20 of them drawn
}
COVERING = ["iid", "dirichlet", "pathological", "shards"]


def test_schemes_lists_every_scheme_in_order():
    assert SCHEMES == tuple(SCHEME_CASES)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_clients_are_disjoint_and_in_range(labels, scheme):
    parts = partition(labels, scheme, 20, seed=0, **SCHEME_CASES[scheme])
    assert len(parts) == 20
    assert_disjoint_in_range(parts, len(labels))


@pytest.mark.parametrize("scheme", COVERING)
def test_partition_covers_the_pool(labels, scheme):
    parts = partition(labels, scheme, 20, seed=0, **SCHEME_CASES[scheme])
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(labels)))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_same_seed_same_partition_different_seed_different(labels, scheme):
    first = partition(labels, scheme, 20, seed=3, **SCHEME_CASES[scheme])
    again = partition(labels, scheme, 20, seed=3, **SCHEME_CASES[scheme])
    other = partition(labels, scheme, 20, seed=4, **SCHEME_CASES[scheme])
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


def test_partition_does_not_touch_global_random_state(labels):
    np.random.seed(123)
    expected = np.random.random()
    np.random.seed(123)
    partition(labels, "dirichlet", 20, seed=0, alpha=0.1)
    assert np.random.random() == expected


# --- iid (§1.1)


def test_iid_sizes_differ_by_at_most_one():
    labels = shuffled_labels([7, 5, 9])  # 21 samples over 4 clients
    sizes = [len(p) for p in partition(labels, "iid", 4, seed=0)]
    assert sum(sizes) == 21 and max(sizes) - min(sizes) <= 1


def test_iid_samples_per_client_gives_exact_sizes(labels):
    parts = partition(labels, "iid", 10, seed=0, samples_per_client=500)
    assert [len(p) for p in parts] == [500] * 10
    assert_disjoint_in_range(parts, len(labels))


# --- pathological (§1.2)


@pytest.mark.parametrize("balanced", [False, True])
def test_pathological_four_clients_share_each_class_pair(labels, balanced):
    parts = partition(labels, "pathological", 20, seed=0, classes_per_client=2, balanced=balanced)
    expected = [{2 * (c // 4), 2 * (c // 4) + 1} for c in range(20)]  # PFedCS Fig. 1
    assert classes_of(parts, labels) == expected


def test_pathological_three_classes_leaves_last_clients_one_class(labels):
    parts = partition(labels, "pathological", 20, seed=0, classes_per_client=3)
    expected = [{0, 1, 2}] * 6 + [{3, 4, 5}] * 6 + [{6, 7, 8}] * 6 + [{9}] * 2
    assert classes_of(parts, labels) == expected
    assert_disjoint_in_range(parts, len(labels))
    assert sum(map(len, parts)) == len(labels)


@pytest.mark.parametrize("per_client", [1, 2, 3, 4, 7, 10])
def test_pathological_clients_hold_at_most_c_classes(labels, per_client):
    parts = partition(labels, "pathological", 20, seed=1, classes_per_client=per_client)
    assert all(1 <= len(c) <= per_client for c in classes_of(parts, labels))


def test_pathological_balanced_gives_floor_share_and_last_takes_rest(labels):
    parts = partition(labels, "pathological", 20, seed=0, classes_per_client=2, balanced=True)
    counts = class_counts(parts, labels, 10)
    share = MNIST_CLASS_SIZES[0] // 4
    assert counts[:4, 0].tolist() == [share, share, share, MNIST_CLASS_SIZES[0] - 3 * share]


def test_pathological_unbalanced_draws_from_the_spec_range(labels):
    parts = partition(labels, "pathological", 20, seed=0, classes_per_client=2)
    counts = class_counts(parts, labels, 10)
    for k, size in enumerate(MNIST_CLASS_SIZES):
        holders = counts[:, k][counts[:, k] > 0]
        per = size / 4
        low, high = int(max(per / 10, 40 / 10)), int(per)  # least = 40 for this pool
        assert all(low <= n < high for n in holders[:3])
        assert holders.sum() == size
    assert len({len(p) for p in parts}) > 10, "the papers' 'different numbers of samples'"


# --- dirichlet (§1.3)


def max_class_share(parts, labels):
    counts = class_counts(parts, labels, 10)
    return counts.max(axis=1) / counts.sum(axis=1)


def test_dirichlet_default_least_is_forty(labels):
    for seed in range(5):
        parts = partition(labels, "dirichlet", 20, seed=seed, alpha=0.1)
        assert min(map(len, parts)) >= 40


def test_dirichlet_respects_explicit_least(labels):
    parts = partition(labels, "dirichlet", 20, seed=0, alpha=0.1, least=800)
    assert min(map(len, parts)) >= 800


def test_dirichlet_small_alpha_makes_clients_nearly_single_class(labels):
    parts = partition(labels, "dirichlet", 20, seed=0, alpha=0.1)
    assert max_class_share(parts, labels).mean() > 0.6


def test_dirichlet_large_alpha_is_near_uniform(labels):
    parts = partition(labels, "dirichlet", 20, seed=0, alpha=1000.0)
    counts = class_counts(parts, labels, 10)
    proportions = counts / counts.sum(axis=1, keepdims=True)
    pool = np.array(MNIST_CLASS_SIZES) / sum(MNIST_CLASS_SIZES)
    assert np.abs(proportions - pool).max() < 0.03


def test_dirichlet_gives_up_after_max_tries(labels):
    with pytest.raises(PartitionError, match=r"max_tries=3.*raise alpha"):
        partition(labels, "dirichlet", 20, seed=0, alpha=0.01, least=3000, max_tries=3)


# --- dirichlet_client (§1.4)


def test_dirichlet_client_gives_exact_sizes_and_skew(labels):
    parts = partition(labels, "dirichlet_client", 20, seed=0, alpha=0.1, samples_per_client=1000)
    assert [len(p) for p in parts] == [1000] * 20
    assert max_class_share(parts, labels).mean() > 0.6


def test_dirichlet_client_fills_from_other_classes_when_a_class_runs_out():
    labels = shuffled_labels([5, 200, 200])
    parts = partition(labels, "dirichlet_client", 4, seed=0, alpha=0.05, samples_per_client=100)
    assert [len(p) for p in parts] == [100] * 4
    assert_disjoint_in_range(parts, len(labels))


# --- shards (§1.5)


def test_shards_give_equal_sizes_and_at_most_s_classes_when_shards_align():
    labels = shuffled_labels([300] * 10)  # 20 shards of 150: no shard spans two classes
    parts = partition(labels, "shards", 10, seed=0, shards_per_client=2)
    assert [len(p) for p in parts] == [300] * 10
    assert all(len(c) <= 2 for c in classes_of(parts, labels))


def test_shards_sizes_differ_by_at_most_s_when_uneven(labels):
    sizes = [len(p) for p in partition(labels, "shards", 30, seed=0, shards_per_client=3)]
    assert sum(sizes) == len(labels) and max(sizes) - min(sizes) <= 3


# --- group_dominant (§1.6)


def test_group_dominant_gives_172_and_12(labels):
    parts = partition(labels, "group_dominant", 20, seed=0, s=0.2, samples_per_client=600)
    counts = class_counts(parts, labels, 10)
    for client in range(20):
        group = client * 5 // 20
        dominant = {(2 * group + j) % 10 for j in range(3)}
        expected = [172 if k in dominant else 12 for k in range(10)]
        assert counts[client].tolist() == expected


def test_group_dominant_s_one_is_iid_60_per_class(labels):
    parts = partition(labels, "group_dominant", 20, seed=0, s=1.0, samples_per_client=600)
    assert (class_counts(parts, labels, 10) == 60).all()


def test_group_dominant_fails_when_a_class_runs_out():
    labels = shuffled_labels([100] * 10)
    with pytest.raises(PartitionError, match="not enough samples of class 2"):
        partition(labels, "group_dominant", 20, seed=0, samples_per_client=60)


# --- nway_kshot (§1.7)


@pytest.mark.parametrize("n,noise", [(3, 1), (4, 2), (5, 1)])
def test_nway_kshot_ways_and_shots_ranges(labels, n, noise):
    parts = partition(labels, "nway_kshot", 20, seed=0, n=n, k=100, n_noise=noise, k_noise=noise)
    counts = class_counts(parts, labels, 10)
    for row in counts:
        held = row[row > 0]
        assert max(2, n - noise) <= len(held) <= min(9, n + noise)
        assert len(set(held.tolist())) == 1, "same number of samples in each class"
        assert 100 - noise + 1 <= held[0] <= 100 + noise


# --- split_train_test (§1.9)


@pytest.mark.parametrize("ratio", [0.75, 0.8, 0.9])
def test_stratified_split_keeps_each_class_ratio_within_one_sample(labels, ratio):
    part = partition(labels, "dirichlet", 20, seed=0, alpha=0.5)[0]
    train, test = split_train_test(part, labels, ratio, seed=0, client=0)
    assert np.array_equal(np.sort(np.concatenate([train, test])), part)
    assert len(np.intersect1d(train, test)) == 0
    for k in np.unique(labels[part]):
        m = np.sum(labels[part] == k)
        if m > 1:
            assert abs(np.sum(labels[train] == k) - ratio * m) <= 1


def test_stratified_split_rounds_half_up_and_keeps_singletons_in_train():
    labels = np.array([0, 1, 1, 2, 2, 2, 2, 2])
    train, test = split_train_test(np.arange(8), labels, 0.9, seed=0, client=0)
    assert np.bincount(labels[test], minlength=3).tolist() == [0, 0, 1]  # 0.1*5 = 0.5 -> 1
    train, test = split_train_test(np.arange(8), labels, 0.75, seed=0, client=0)
    assert np.bincount(labels[test], minlength=3).tolist() == [0, 1, 1]  # 0.5 -> 1, 1.25 -> 1


def test_unstratified_split_takes_floor_of_ratio_for_train():
    labels = np.zeros(110, dtype=np.int64)
    train, test = split_train_test(np.arange(100, 110), labels, 0.75, seed=0, client=0,
                                   stratified=False)
    assert (len(train), len(test)) == (7, 3)


def test_split_depends_on_seed_and_client(labels):
    part = np.arange(200)
    first = split_train_test(part, labels, 0.75, seed=0, client=0)[1]
    assert np.array_equal(first, split_train_test(part, labels, 0.75, seed=0, client=0)[1])
    assert not np.array_equal(first, split_train_test(part, labels, 0.75, seed=0, client=1)[1])
    assert not np.array_equal(first, split_train_test(part, labels, 0.75, seed=1, client=0)[1])


# --- test_from_official (§1.7 step 5, §1.8)


@pytest.fixture(scope="module")
def official():
    train_labels = shuffled_labels(TRAIN_CLASS_SIZES, seed=1)
    test_labels = shuffled_labels(TEST_CLASS_SIZES, seed=2)
    parts = partition(train_labels, "dirichlet", 10, seed=0, alpha=0.5, least=10)
    return parts, train_labels, test_labels


def test_official_fraction_takes_rounded_tenth_of_each_class(official):
    parts, train_labels, test_labels = official
    tests = test_from_official(parts, train_labels, test_labels, seed=0, fraction=0.1)
    train_counts = class_counts(parts, train_labels, 10)
    test_counts = class_counts(tests, test_labels, 10)
    assert (test_counts == np.floor(0.1 * train_counts + 0.5)).all()
    assert_disjoint_in_range(tests, len(test_labels))


def test_official_shots_takes_that_many_of_each_held_class():
    train_labels = shuffled_labels(TRAIN_CLASS_SIZES)
    test_labels = shuffled_labels(TEST_CLASS_SIZES)
    parts = partition(train_labels, "nway_kshot", 5, seed=0, n=3, k=20)
    tests = test_from_official(parts, train_labels, test_labels, seed=0, shots=15)
    held = class_counts(parts, train_labels, 10) > 0
    assert (class_counts(tests, test_labels, 10) == np.where(held, 15, 0)).all()
    assert_disjoint_in_range(tests, len(test_labels))


def test_official_reuses_with_a_warning_when_a_class_pool_runs_out():
    train_labels, test_labels = np.zeros(100, dtype=np.int64), np.zeros(30, dtype=np.int64)
    parts = [np.arange(0, 50), np.arange(50, 100)]
    with pytest.warns(UserWarning, match="exhausted"):
        tests = test_from_official(parts, train_labels, test_labels, seed=0, shots=20)
    assert all(len(np.unique(t)) == 20 for t in tests), "no duplicates within a client"
    assert len(np.intersect1d(*tests)) == 10


def test_official_needs_no_warning_while_pools_last(official):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        test_from_official(*official, seed=0, fraction=0.1)


@pytest.mark.parametrize("kwargs", [{}, {"fraction": 0.1, "shots": 5}])
def test_official_needs_exactly_one_of_fraction_and_shots(official, kwargs):
    with pytest.raises(PartitionError, match="exactly one of fraction"):
        test_from_official(*official, seed=0, **kwargs)


def test_official_fails_when_one_client_needs_more_than_the_pool(official):
    with pytest.raises(PartitionError, match="not enough test samples"):
        test_from_official(*official, seed=0, shots=500)


# --- class_counts


def test_class_counts_matrix():
    labels = np.array([0, 1, 1, 2, 2, 2])
    counts = class_counts([np.array([0, 1]), np.array([2, 3, 4, 5])], labels, 4)
    assert counts.dtype == np.int64
    assert counts.tolist() == [[1, 1, 0, 0], [0, 1, 3, 0]]


# --- bad inputs


@pytest.mark.parametrize(
    "scheme,num_clients,params,named",
    [
        ("dirichlet", 20, {"alpha": 0}, "alpha"),
        ("dirichlet", 20, {"alpha": -1.0}, "alpha"),
        ("dirichlet_client", 20, {"alpha": 0.0}, "alpha"),
        ("dirichlet", 20, {}, "alpha"),
        ("dirichlet", 20, {"alpha": 0.5, "least": 5000}, "least"),
        ("pathological", 20, {"classes_per_client": 0}, "classes_per_client"),
        ("pathological", 20, {"classes_per_client": 11}, "classes_per_client"),
        ("pathological", 20, {}, "classes_per_client"),
        ("iid", 0, {}, "num_clients"),
        ("iid", 70_001, {}, "num_clients"),
        ("iid", 20, {"samples_per_client": 4000}, "samples_per_client"),
        ("group_dominant", 20, {"s": 1.5}, "s must be"),
        ("group_dominant", 20, {"s": -0.1}, "s must be"),
        ("group_dominant", 20, {"samples_per_client": 10_000}, "not enough samples of class"),
        ("shards", 20, {"shards_per_client": 0}, "shards_per_client"),
        ("nway_kshot", 20, {"n": 12, "n_noise": 1}, "ways range"),
        ("nway_kshot", 20, {"k_noise": 0}, "shots range"),
        ("nway_kshot", 20, {"k": 3000}, "not enough samples of class"),
        ("iid", 20, {"alpha": 0.5}, "alpha"),
        ("dirichlet", 20, {"alpha": 0.5, "classes_per_client": 2}, "classes_per_client"),
    ],
)
def test_bad_input_raises_partition_error_naming_the_parameter(labels, scheme, num_clients, params,
                                                               named):
    with pytest.raises(PartitionError, match=named):
        partition(labels, scheme, num_clients, seed=0, **params)


def test_unknown_scheme_lists_the_allowed_ones(labels):
    with pytest.raises(PartitionError, match="dirichlet.*pathological.*nway_kshot"):
        partition(labels, "label_skew", 20, seed=0)


def test_pathological_fails_when_a_class_cannot_be_shared():
    labels = shuffled_labels([3, 100])
    with pytest.raises(PartitionError, match="not enough samples of class 0"):
        partition(labels, "pathological", 8, seed=0, classes_per_client=2, balanced=True)


@pytest.mark.parametrize("seed", [-1, 1.5])
def test_bad_seed_is_named(labels, seed):
    with pytest.raises(PartitionError, match="seed"):
        partition(labels, "iid", 20, seed=seed)


def test_bad_train_ratio_is_named(labels):
    with pytest.raises(PartitionError, match="train_ratio"):
        split_train_test(np.arange(10), labels, 1.5, seed=0, client=0)


def test_partition_error_is_a_value_error():
    assert issubclass(PartitionError, ValueError)


@pytest.mark.parametrize("seed", range(5))
def test_dirichlet_gives_no_more_samples_to_a_client_already_at_the_average_size(seed):
    """§1.3's cap: classes are dealt in ascending order; once a client holds >= N/K samples it gets
    nothing of the later classes (unless every client is capped). Without the cap, sizes spread."""
    labels = np.repeat(np.arange(10), 100)
    parts = pfedkit_partition(labels, "dirichlet", num_clients=10, seed=seed, alpha=0.1, least=0)
    counts = np.stack([np.bincount(labels[p], minlength=10) for p in parts])  # [client, class]
    before = np.cumsum(counts, axis=1) - counts  # each client's size before class c is dealt
    average = len(labels) / 10
    exercised = False
    for c in range(10):
        capped = before[:, c] >= average
        if not capped.all():
            assert (counts[capped, c] == 0).all(), f"class {c} went to a client already at the average"
            exercised |= bool(capped.any())
    assert exercised, "the scenario must exercise the cap"


def test_public_partition_function_is_importable_from_pfedkit_data():
    labels = np.repeat(np.arange(4), 25)
    parts = pfedkit_partition(labels, "iid", num_clients=4, seed=0)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(100))
    assert callable(pfedkit_partition)
    assert all(np.array_equal(a, b) for a, b in zip(parts, partition(labels, "iid", 4, 0)))


def test_pool_fraction_is_a_seeded_stratified_subset():
    from pfedkit.data.partition import stratified_subset

    labels = np.repeat(np.arange(4), [100, 40, 10, 3])
    indices = np.arange(1000, 1000 + len(labels))
    part = stratified_subset(indices, labels, 0.5, seed=2)
    assert np.array_equal(part, stratified_subset(indices, labels, 0.5, seed=2))
    assert not np.array_equal(part, stratified_subset(indices, labels, 0.5, seed=3))
    kept = labels[part - 1000]
    assert np.bincount(kept, minlength=4).tolist() == [50, 20, 5, 2]  # round(0.5 * n_c) per class
    assert np.all(np.diff(part) > 0) and set(part) <= set(indices)
    assert stratified_subset(indices, labels, 1.0, seed=2) is indices


def test_pool_fraction_shrinks_the_run(small_config):
    from pfedkit.config import load_config
    from pfedkit.runs import prepare

    full = prepare(load_config(small_config)).data
    half = prepare(load_config({**small_config, "partition": {**small_config["partition"], "pool_fraction": 0.5}})).data
    total = sum(c.n_train + c.n_test for c in full.clients)
    assert abs(sum(c.n_train + c.n_test for c in half.clients) - total / 2) <= full.num_classes
