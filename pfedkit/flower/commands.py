"""`pfedkit flower simulate | app | local | certs` (README, "Beyond one machine").

Flower is imported only when a command runs, so `pfedkit` works without the `flower` extra; the
rest too, since the command line builds this parser for every command (even `--version`).
"""
from __future__ import annotations

import argparse
import json
from datetime import datetime
from pathlib import Path

from pfedkit.core.errors import ConfigError


def _config(items: list[str]):
    from pfedkit.config import load_config, split_config_and_overrides
    from pfedkit.flower.checks import check_flower_config

    source, overrides = split_config_and_overrides(items)
    return check_flower_config(load_config(source, overrides))


def _require_flower() -> None:
    try:
        import flwr  # noqa: F401
    except ImportError:
        raise ConfigError("Flower is not installed: pip install -e '.[flower]'") from None


def cmd_simulate(ns: argparse.Namespace) -> int:
    _require_flower()
    from pfedkit.flower.app import simulate
    from pfedkit.report.summary_table import results_table

    result = simulate(_config(ns.items), quiet=ns.quiet)
    print(results_table([result.summary]))
    print(f"run directory: {result.run_dir}")
    return 0


def _check_app_directory(directory: Path, what: str) -> None:
    """The app directory must be a folder that can be made or written (not a file): checked
    before Flower is needed and before anything is written."""
    from pfedkit.writable import check_writable_dir

    check_writable_dir(directory, what)


def cmd_app(ns: argparse.Namespace) -> int:
    _check_app_directory(Path(ns.directory), "flower app directory")
    _require_flower()
    from pfedkit.flower.deploy import write_app

    config = _config(ns.items)
    app = write_app(ns.directory, config, address=ns.address, ca_cert=Path(ns.ca) if ns.ca else None)
    security = f"--root-certificates {ns.ca}" if ns.ca else "--insecure"
    print(f"Flower app written to {app} ({config.algorithm} on {config.dataset}, {config.num_clients} clients).\n"
          f"1. on the server:  flower-superlink {'--ssl-ca-certfile CA --ssl-certfile CERT --ssl-keyfile KEY' if ns.ca else '--insecure'} "
          f"--host 0.0.0.0 --port {ns.address.rsplit(':', 1)[-1]} --disable-runtime-dependency-installation\n"
          f"2. per client N in 0..{config.num_clients - 1}:  flower-supernode {security} --superlink {ns.address} "
          f"--node-config 'partition-id=N num-partitions={config.num_clients} data-dir=\"DATA_DIR\"'\n"
          f"3. start the run:  FLWR_HOME={app / 'flwr-home'} flwr run {app} pfedkit --stream")
    return 0


def cmd_local(ns: argparse.Namespace) -> int:
    _require_flower()
    from pfedkit.data.hf import file_label
    from pfedkit.flower.certificates import make_certificates
    from pfedkit.flower.deploy import LocalDeployment
    from pfedkit.report.summary_table import results_table

    config = _config(ns.items)
    if config.name is None:
        config = config.model_copy(update={"name": f"flower-{config.algorithm}-{file_label(config.dataset)}-{datetime.now():%Y%m%d-%H%M%S}"})
    home = Path(ns.app or Path(config.out_dir) / f"{config.name}-app")
    _check_app_directory(home, "--app" if ns.app else "out_dir")
    tls = make_certificates(home / "certs", nodes=config.num_clients) if ns.tls else None
    deployment = LocalDeployment(home, config.num_clients, data_dir=config.data_dir, tls=tls)
    deployment.write_app(config)
    print(f"SuperLink on {deployment.address}{' (TLS, node authentication)' if tls else ''}, "
          f"{config.num_clients} SuperNodes; logs in {home / 'logs'}", flush=True)
    with deployment:
        finished = deployment.run(timeout=ns.timeout, capture=False)
    run_dir = Path(config.out_dir).resolve() / config.name
    if finished.returncode != 0 or not (run_dir / "summary.json").is_file():
        print(f"error: the Flower run failed (flwr exit status {finished.returncode}); see {home / 'logs'}")
        return 1
    print(results_table([json.loads((run_dir / "summary.json").read_text())]))
    print(f"run directory: {run_dir}")
    return 0


def cmd_certs(ns: argparse.Namespace) -> int:
    _require_flower()
    from pfedkit.flower.certificates import make_certificates

    _check_app_directory(Path(ns.directory), "certificate directory")
    ns.host = ns.host or ["127.0.0.1", "localhost"]
    files = make_certificates(ns.directory, nodes=ns.nodes, hosts=tuple(ns.host))
    print(f"CA {files.ca_cert}; SuperLink certificate {files.server_cert} (for {', '.join(ns.host)}), key "
          f"{files.server_key}; node keys: {', '.join(str(k) for k in files.node_keys) or 'none'}")
    return 0


def add_parser(sub) -> None:
    p_flower = sub.add_parser("flower", help="run on Flower: simulation, or a real deployment (SuperLink + SuperNodes)")
    flower_sub = p_flower.add_subparsers(dest="flower_command", required=True)
    p_sim = flower_sub.add_parser("simulate", help="the config in Flower's simulation engine (same metrics as run)")
    p_sim.add_argument("items", nargs="*", help="[CONFIG.yaml] [key=value ...]")
    p_sim.add_argument("-q", "--quiet", action="store_true")
    p_sim.set_defaults(func=cmd_simulate)

    p_app = flower_sub.add_parser("app", help="write a Flower app directory for the config (for flwr run)")
    p_app.add_argument("directory")
    p_app.add_argument("items", nargs="*", help="[CONFIG.yaml] [key=value ...]")
    p_app.add_argument("--address", default="127.0.0.1:8000", help="the SuperLink's HOST:PORT as flwr reaches it")
    p_app.add_argument("--ca", help="CA certificate for TLS (default: insecure)")
    p_app.set_defaults(func=cmd_app)

    p_local = flower_sub.add_parser("local", help="a SuperLink and one SuperNode per client on this machine, then the run")
    p_local.add_argument("items", nargs="*", help="[CONFIG.yaml] [key=value ...]")
    p_local.add_argument("--app", help="app directory (default OUT_DIR/NAME-app)")
    p_local.add_argument("--tls", action="store_true", help="TLS and node authentication with certificates made here")
    p_local.add_argument("--timeout", type=float, default=None, help="stop after this many seconds")
    p_local.set_defaults(func=cmd_local)

    p_certs = flower_sub.add_parser("certs", help="a CA, a SuperLink certificate and node keys (TLS + node auth)")
    p_certs.add_argument("directory")
    p_certs.add_argument("--nodes", type=int, default=0, help="node key pairs to make")
    p_certs.add_argument("--host", action="append", default=None, help="SuperLink IP or name (repeatable)")
    p_certs.set_defaults(func=cmd_certs)
