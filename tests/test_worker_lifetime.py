"""Workers of `backend=processes` end with the main process, however it ends.

A run killed by SIGTERM (a batch scheduler's time limit), SIGINT or SIGKILL must not leave its
workers alive under PID 1: each one holds the federation's data (hundreds of MB) and a core.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def children_of(pid: int) -> set[int]:
    """The processes whose parent is `pid` (from /proc/PID/stat's fourth field)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # ended while we looked
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; only its exit status waits to be read


def wait_until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_workers_end_with_the_main_process(sig, tmp_path):
    args = ["run", "-q", "backend=processes", "workers=2", "threads=1", "rounds=500", "num_clients=6",
            f"out_dir={tmp_path}"]
    main = subprocess.Popen([sys.executable, "-m", "pfedkit.cli", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: len(children_of(main.pid)) >= 2 and list(tmp_path.glob("*/metrics.csv")), 120), \
            "the run did not start its workers"
        workers = children_of(main.pid)
        os.kill(main.pid, sig)
        main.wait(timeout=60)
        assert wait_until(lambda: not any(alive(w) for w in workers), 20), \
            f"workers {sorted(w for w in workers if alive(w))} outlived the main process ({sig.name})"
    finally:
        if main.poll() is None:
            main.kill()
            main.wait()
