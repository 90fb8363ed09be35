"""Datasets, partitions and federated views.

The partition function is re-exported here so that the foundation's documented call works:

    from pfedkit.data import partition
    parts = partition(labels, "dirichlet", num_clients=20, seed=0, alpha=0.1)

(the module of the same name stays importable as `pfedkit.data.partition` in `from` imports).
"""
from pfedkit.data.partition import PartitionError, class_counts, partition, split_train_test

__all__ = ["PartitionError", "class_counts", "partition", "split_train_test"]
