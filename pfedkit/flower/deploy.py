"""Deployment: a Flower app directory for a run, and a SuperLink with N SuperNodes on this machine.

`write_app(DIR, config)` makes DIR a Flower app whose ServerApp and ClientApp are pfedkit's
(`pfedkit.flower.app`), with the run's resolved config in `[tool.flwr.app.config]`, and a Flower
configuration (DIR/flwr-home/config.toml) naming the SuperLink connection `pfedkit`. On real
machines you start `flower-superlink` and one `flower-supernode` per client yourself (README,
"Beyond one machine"); `LocalDeployment` starts them all on loopback, as separate processes, which
is what `pfedkit flower local` and the tests use. pfedkit must be installed wherever a process runs:
runtime dependency installation is switched off (no network).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pfedkit.config import Config

CONNECTION = "pfedkit"
OFFLINE_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
               "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}


@dataclass(frozen=True)
class TLSFiles:
    """A CA certificate, the SuperLink's certificate and key (TLS), and for node authentication the
    nodes' ECDSA key pairs (private key paths; the public key is PATH.pub)."""
    ca_cert: Path
    server_cert: Path
    server_key: Path
    node_keys: tuple[Path, ...] = ()


def _toml_string(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid TOML basic string


def write_app(directory: str | Path, config: Config, address: str = "127.0.0.1:8000",
              ca_cert: Path | None = None) -> Path:
    """Write the Flower app for `config` into `directory`, connecting to the SuperLink at `address`
    (over TLS trusting `ca_cert`, else insecure); returns it. Paths in the config (data_dir,
    out_dir) are made absolute, since the ServerApp runs in the SuperLink's directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    settings = config.to_dict()
    settings["out_dir"] = str(Path(config.out_dir).resolve())
    if config.data_dir:
        settings["data_dir"] = str(Path(config.data_dir).resolve())
    (directory / "pyproject.toml").write_text(f"""[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "pfedkit-run"
version = "1.0.0"
description = "A pfedkit run as a Flower app (made by `pfedkit flower app`)"
license = "MIT"
dependencies = []  # pfedkit must be installed on the SuperLink's and every SuperNode's machine

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "pfedkit"

[tool.flwr.app.components]
serverapp = "pfedkit.flower.app:server_app"
clientapp = "pfedkit.flower.app:client_app"

[tool.flwr.app.config]
config = {_toml_string(json.dumps(settings, sort_keys=True))}
""")
    home = directory / "flwr-home"
    home.mkdir(exist_ok=True)
    security = (f"root-certificates = {_toml_string(str(Path(ca_cert).resolve()))}" if ca_cert
                else "insecure = true")
    (home / "config.toml").write_text(f"""[superlink]
default = "{CONNECTION}"

[superlink.{CONNECTION}]
address = "{address}"
{security}
""")
    return directory


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def flower_command(name: str) -> list[str]:
    """The Flower console script `name` next to this Python (flwr, flower-superlink, ...)."""
    found = Path(sys.executable).parent / name
    return [str(found)] if found.exists() else [shutil.which(name) or name]


@dataclass
class LocalDeployment:
    """A SuperLink and `nodes` SuperNodes (partition-id 0..nodes-1) as processes on loopback.

    Use as a context manager: every process it started is stopped by its PID on exit."""
    app_dir: Path
    nodes: int
    data_dir: str | None = None
    tls: TLSFiles | None = None
    logs: Path | None = None
    port: int = field(default_factory=free_port)
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.app_dir = Path(self.app_dir)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        return {**os.environ, **OFFLINE_ENV, "FLWR_HOME": str(Path(self.app_dir, "flwr-home").resolve())}

    def _spawn(self, name: str, command: list[str]) -> None:
        logs = Path(self.logs or self.app_dir / "logs")
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / f"{name}.log", "wb") as out:
            self.processes[name] = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=self.env(),
                                                    cwd=self.app_dir, start_new_session=True)

    def start(self) -> "LocalDeployment":
        security = (["--ssl-ca-certfile", str(self.tls.ca_cert), "--ssl-certfile", str(self.tls.server_cert),
                     "--ssl-keyfile", str(self.tls.server_key)] if self.tls else ["--insecure"])
        if self.tls and self.tls.node_keys:
            security.append("--enable-supernode-auth")
        self._spawn("superlink", flower_command("flower-superlink") + security + [
            "--host", "127.0.0.1", "--port", str(self.port), "--disable-runtime-dependency-installation"])
        self.wait_for_port(self.port)
        if self.tls and self.tls.node_keys:
            for key in self.tls.node_keys:
                self.register_node(key)
        for cid in range(self.nodes):
            self.start_node(cid)
        return self

    def write_app(self, config: Config) -> Path:
        """The app for `config`, connecting to this deployment's SuperLink (TLS when it has it)."""
        return write_app(self.app_dir, config, address=self.address, ca_cert=self.tls.ca_cert if self.tls else None)

    def start_node(self, cid: int, auth_key: Path | None = None) -> None:
        """SuperNode with partition-id `cid`; with node authentication it signs with `auth_key`
        (default: the deployment's key of node `cid`)."""
        node_config = f"partition-id={cid} num-partitions={self.nodes}"
        if self.data_dir:
            node_config += f' data-dir="{Path(self.data_dir).resolve()}"'
        security = ["--root-certificates", str(self.tls.ca_cert)] if self.tls else ["--insecure"]
        if self.tls and self.tls.node_keys:
            security += ["--auth-supernode-private-key", str(auth_key or self.tls.node_keys[cid])]
        self._spawn(f"supernode-{cid}", flower_command("flower-supernode") + security + [
            "--superlink", self.address, "--host", "127.0.0.1", "--port", str(free_port()),
            "--node-config", node_config])

    def register_node(self, private_key: Path) -> None:
        """Register a node's public key with the SuperLink (node authentication)."""
        subprocess.run(flower_command("flwr") + ["supernode", "register", f"{private_key}.pub", CONNECTION],
                       check=True, env=self.env(), cwd=self.app_dir, capture_output=True, timeout=120)

    def run(self, timeout: float | None = None, capture: bool = True) -> subprocess.CompletedProcess:
        """`flwr run APP pfedkit --stream`: start the run and follow its log until it ends."""
        return subprocess.run(flower_command("flwr") + ["run", str(self.app_dir), CONNECTION, "--stream"],
                              env=self.env(), cwd=self.app_dir, capture_output=capture, text=True, timeout=timeout)

    def kill(self, name: str) -> None:
        process = self.processes.get(name)
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def stop(self) -> None:
        for name in reversed(list(self.processes)):
            process = self.processes[name]
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for name, process in self.processes.items():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill(name)

    @staticmethod
    def wait_for_port(port: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f} s")

    def __enter__(self) -> "LocalDeployment":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
