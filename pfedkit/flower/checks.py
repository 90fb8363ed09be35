"""What a Flower run refuses in a config, shared by the command line and the server app (which a
user may also start by hand with `flwr run`). Imports no Flower, so `--help` works without it."""
from __future__ import annotations

from pfedkit.core.errors import ConfigError


def check_flower_config(config):
    """Refuse what Flower nodes cannot honour (one line). Nodes build their own partitions
    (`pfedkit.flower.node`) without carving a validation split, so with validation_fraction > 0
    the server would count and evaluate other samples than the nodes train on."""
    if config.validation_fraction > 0:
        raise ConfigError(f"validation_fraction={config.validation_fraction:g}: Flower nodes do not carve "
                          "validation splits; allowed with pfedkit flower: 0 (tune with pfedkit tune / pfedkit run)")
    return config
