"""Flower apps over pfedkit, and `pfedkit flower simulate`.

- `client_app`: the ClientApp of every node (simulation and deployment alike); see `node`.
- `server_app`: the ServerApp of a deployment. It reads the run's config from the app's run
  config key `config` (the resolved config as JSON, which `pfedkit flower app DIR` writes into
  DIR/pyproject.toml) and runs `serve`, which writes an ordinary run directory.
- `simulate(config)`: the same apps in Flower's simulation engine (Ray), one virtual node per
  client, in this process's Python (no app packaging).
"""
from __future__ import annotations

import json
import os

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from pfedkit.config import Config
from pfedkit.core.errors import ConfigError
from pfedkit.engine.device import resolve_device
from pfedkit.flower import node
from pfedkit.flower.server import serve

# Offline machines: no telemetry, no update check, no `uv sync` of the app at run time.
for _name in ("FLWR_TELEMETRY_ENABLED", "FLWR_DISABLE_UPDATE_CHECK", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"):
    os.environ.setdefault(_name, "0" if _name == "FLWR_TELEMETRY_ENABLED" else "1")

client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    return node.handle(msg, context)


@client_app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return node.handle(msg, context)


@client_app.query()
def query(msg: Message, context: Context) -> Message:
    return node.handle(msg, context)


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    text = str(context.run_config.get("config", "") or "")
    if not text:
        raise ConfigError("the ServerApp needs the run's config in its run config key `config`; "
                          "make the app with `pfedkit flower app DIR CONFIG`")
    serve(grid, Config(**json.loads(text)), quiet=False)


def simulate(config: Config, quiet: bool = True):
    """Run `config` in Flower's simulation engine; returns the run's `pfedkit.runs.Result`."""
    from flwr.simulation import run_simulation

    from pfedkit.engine.runtimes.ray import import_ray

    import_ray()
    resolve_device(config.device, "sequential")  # the virtual nodes train on this machine: refuse here, once
    results = []
    app = ServerApp()

    @app.main()
    def _main(grid: Grid, context: Context) -> None:
        results.append(serve(grid, config, quiet=quiet))

    init_args = {"include_dashboard": False, "log_to_driver": False}
    if config.ray.address:
        init_args["address"] = config.ray.address
    elif config.workers:
        init_args["num_cpus"] = int(config.workers * config.flower.client_cpus)
    run_simulation(app, client_app, num_supernodes=config.num_clients, backend_name="ray",
                   backend_config={"client_resources": {"num_cpus": config.flower.client_cpus,
                                                        "num_gpus": config.flower.client_gpus},
                                   "init_args": init_args})
    if not results:
        raise RuntimeError("the Flower simulation ended without a result (see the log above)")
    return results[0]
