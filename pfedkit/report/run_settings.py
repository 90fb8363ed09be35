"""The settings of a comparison's runs in words, for the top of its page: dataset and model,
clients, partition, rounds, local training. A setting the runs do not share lists its values."""
from __future__ import annotations

from collections.abc import Callable

from pfedkit.config import Config


def partition_words(config: Config) -> str:
    """`dirichlet (alpha 0.5)`: the scheme and the options it reads (not its retry budget)."""
    part = config.partition
    options = {key: value for key, value in part.scheme_params().items() if key != "max_tries"}
    words = part.scheme + (f" ({', '.join(f'{key} {value}' for key, value in options.items())})" if options else "")
    return words + (f", pool fraction {part.pool_fraction:g}" if part.pool_fraction < 1 else "")


def clients_words(config: Config) -> str:
    joining = "" if config.join_ratio == 1 else f", join ratio {config.join_ratio:g}"
    new = f", {config.new_clients} never training (new_clients)" if config.new_clients else ""
    return f"{config.num_clients}{joining}{new}"


def local_words(config: Config) -> str:
    if config.local_steps:
        amount = f"{config.local_steps} steps"
    else:
        amount = f"{config.local_epochs} epoch{'' if config.local_epochs == 1 else 's'}"
    return f"{amount}, batch {config.batch_size}, lr {config.lr:g}"


SETTINGS: tuple[tuple[str, Callable[[Config], str]], ...] = (
    ("dataset", lambda config: f"{config.dataset} (model {config.model})"),
    ("clients", clients_words),
    ("partition", partition_words),
    ("rounds", lambda config: str(config.rounds)),
    ("local training", local_words),
)


def settings_words(configs: list[Config]) -> str:
    """`dataset: digits (model mlp); clients: 10; partition: dirichlet (alpha 0.5); rounds: 5;
    local training: 1 epoch, batch 10, lr 0.05`; a setting with several values among `configs`
    shows them all (`rounds: 5 | 10 (differs between runs)`)."""
    parts = []
    for name, words in SETTINGS:
        values = list(dict.fromkeys(words(config) for config in configs))
        shown = values[0] if len(values) == 1 else f"{' | '.join(values)} (differs between runs)"
        parts.append(f"{name}: {shown}")
    return "; ".join(parts)
