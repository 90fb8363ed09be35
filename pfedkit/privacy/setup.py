"""What a run with `dp` checks and wires once, before its run directory exists.

Refusals are one-line ConfigErrors naming the key, the reason and what is allowed. Client level
wires nothing into the algorithm: `client_dp_aggregation` is the round's aggregation the builder
hands the round loop (`pfedkit.build.simulation_for`).
"""
from __future__ import annotations

from torch import nn

from pfedkit.config import Config
from pfedkit.core.aggregation import MeanOfUploads, StartAggregation
from pfedkit.core.errors import ConfigError
from pfedkit.privacy.accounting import INSTALL_HINT, PrivacyBudget
from pfedkit.privacy.client_dp import ClientDP, ClientDPAggregation
from pfedkit.privacy.dp_sgd import batchnorm_layers


def mean_algorithms() -> list[str]:
    """The registered algorithms client-level DP applies to (for the refusal's `allowed` list): the
    `MeanOfUploads` ones, whose server state is the n_i-weighted mean of the uploads."""
    from pfedkit.algorithms import algorithm_names, get_algorithm

    return [name for name in algorithm_names() if issubclass(get_algorithm(name), MeanOfUploads)]


def client_sampling(config: Config) -> str:
    """"poisson" (each client joins independently) or "fixed" (m of N without replacement)."""
    return "poisson" if config.participants == "poisson" else "fixed"


def check_accounting(config: Config) -> None:
    """The accountant `dp` needs is installed and analyses the configured sampling (one line if not).
    Opacus (RDP or PRV, Poisson sampling): sample level, and client level with participants=poisson;
    dp_accounting (RDP, sampling without replacement): client level with fixed-size sampling."""
    if config.dp.level == "none":
        return
    fixed = config.dp.level == "client" and client_sampling(config) == "fixed"
    if fixed and config.dp.accountant != "rdp":
        raise ConfigError(f"dp.accountant={config.dp.accountant}: client-level DP with participants="
                          f"{config.participants} (fixed-size sampling without replacement) is accounted by "
                          "dp_accounting's RDP analysis; allowed: dp.accountant=rdp, or participants=poisson")
    package, module = ("dp-accounting", "dp_accounting") if fixed else ("opacus", "opacus")
    try:
        __import__(module)
    except ImportError:
        raise ConfigError(f"dp.level={config.dp.level}: the privacy accountant needs the {package} package: "
                          f"{INSTALL_HINT}") from None


def check_client_dp(config: Config, algorithm) -> None:
    """The accountant `dp` needs is there; client level: refuse an algorithm whose server state is
    not the mean of the uploads (not a `MeanOfUploads`)."""
    check_accounting(config)
    if config.dp.level == "client" and not isinstance(algorithm, MeanOfUploads):
        raise ConfigError(f"dp.level=client: algorithm {algorithm.name} does not aggregate by a mean of model "
                          f"updates, so DP-FedAvg's clipping and noise do not apply; allowed with: "
                          f"{', '.join(mean_algorithms())}")


def client_dp_aggregation(config: Config, algorithm) -> StartAggregation | None:
    """Client level: the round's aggregation for the round loop, the clipped, noised mean over the
    algorithm's `averaged` key (with Poisson sampling, over the fixed denominator q N); None
    without client-level DP (the algorithm's own `start_aggregation` then)."""
    if config.dp.level != "client":
        return None
    check_client_dp(config, algorithm)
    expected = None
    if client_sampling(config) == "poisson":  # McMahan et al. 2018: the expected count, not the round's
        expected = config.join_ratio * (algorithm.setup.num_clients - config.new_clients)
    return ClientDPAggregation(ClientDP(config.dp.clip, config.dp.noise_multiplier, config.seed, expected), algorithm)


def check_sample_dp(config: Config, model: nn.Module) -> None:
    """Sample level: DP-SGD runs in the reference trainer, and needs per-sample gradients."""
    if config.dp.level != "sample":
        return
    if config.backend == "vectorized":
        raise ConfigError("dp.level=sample: backend vectorized trains without per-sample clipping; "
                          "allowed: sequential, processes, ray")
    layers = batchnorm_layers(model)
    if layers:
        raise ConfigError(f"dp.level=sample: model {config.model} has BatchNorm ({', '.join(layers[:3])}), which "
                          "mixes the samples of a batch, so per-sample gradients do not exist; set "
                          "dp.replace_batchnorm=true (GroupNorm instead) or choose a model without BatchNorm")


def privacy_budget(config: Config, simulation) -> PrivacyBudget | None:
    """The run's accountant (None without DP), sampling clients as `simulation` does."""
    dp = config.dp
    if dp.level == "none":
        return None
    noise = dp.noise_multiplier if dp.level == "client" else dp.sample_noise_multiplier
    return PrivacyBudget(dp.level, noise, dp.delta, dp.accountant, dp.target_epsilon, simulation.round_participants,
                         len(simulation.training_clients),
                         [client.n_train for client in simulation.data.clients], config.batch_size,
                         config.local_epochs, config.drop_last, client_sampling(config), config.join_ratio,
                         config.local_steps)


def check_a_round_fits(config: Config, simulation) -> None:
    """Refuse a `dp.target_epsilon` that round 1 alone would exceed: no round could run, and a run
    without rounds has no numbers to summarise. Called during setup, so the refusal leaves no run
    directory."""
    budget = privacy_budget(config, simulation)
    if budget is None or budget.target_epsilon is None:
        return
    first = budget.epsilon_next([], 0, budget.participants(1))
    if first > budget.target_epsilon:
        noise = "dp.noise_multiplier" if config.dp.level == "client" else "dp.sample_noise_multiplier"
        raise ConfigError(f"dp.target_epsilon={budget.target_epsilon:g}: round 1 alone reaches epsilon {first:.4g} "
                          f"(delta {budget.delta:g}), so no round can run; give dp.target_epsilon above {first:.4g} "
                          f"or a larger {noise}")
