"""Differential privacy (docs/privacy.md).

- `client_dp`: DP-FedAvg's clipped, uniformly weighted, noised mean of the clients' updates: the
  one implementation, handed to the round loop in place of a `MeanOfUploads` algorithm's own mean
  (`ClientDPAggregation`); the algorithm knows nothing of it.
- `dp_sgd`: sample-level DP-SGD steps for the local trainer (per-sample gradients by torch.func).
- `accounting`: epsilon from dp_accounting (fixed-size client sampling, without replacement) or
  Opacus (Poisson sampling); the run's budget.
- `setup`: the checks and wiring done once when a run is built (refusals are one-line ConfigErrors).
"""
