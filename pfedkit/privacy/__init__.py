"""Differential privacy (docs/privacy.md).

- `client_dp`: DP-FedAvg's clipped, uniformly weighted, noised mean of the clients' updates: the
  one implementation every mean-aggregating algorithm gets through `params_mean_aggregation`.
- `dp_sgd`: sample-level DP-SGD steps for the local trainer (per-sample gradients by torch.func).
- `accounting`: epsilon from dp_accounting (fixed-size client sampling, without replacement) or
  Opacus (Poisson sampling); the run's budget.
- `setup`: the checks and wiring done once when a run is built (refusals are one-line ConfigErrors).
"""
