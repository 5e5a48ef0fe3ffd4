"""Real ``python -m minisgl`` servers for end-to-end tests.

``server`` (session scope) is the default model with the radix cache, an API key and a small
in-flight limit; ``start_server`` starts more (e.g. ``--cache naive``) for tests that need
them. Servers run as subprocesses on free ports and are stopped with SIGTERM at teardown.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
MAX_RUNNING = 40
MAX_QUEUED = 8
STARTUP_TIMEOUT_S = 300.0
MAIN_SERVER_ARGS = (
    "--api-key",
    API_KEY,
    "--max-running-requests",
    str(MAX_RUNNING),
    "--max-queued-requests",
    str(MAX_QUEUED),
    "--max-body-bytes",
    str(1 << 20),
    "--num-pages",
    "16384",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> dict[int, str]:
    """Direct children of ``pid`` and their kernel names (``/proc/PID/comm``)."""
    out: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out[int(entry.name)] = comm
    return out


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@dataclass
class RunningServer:
    proc: subprocess.Popen
    port: int
    log_path: Path
    api_key: str | None
    startup_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def workers(self) -> dict[int, str]:
        return {p: c for p, c in child_pids(self.proc.pid).items() if c.startswith("minisgl-")}

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def start_server(*args: str, api_key: str | None = None) -> RunningServer:
    """Start ``python -m minisgl`` and wait for ``/health``; fail with its log if it dies."""
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="minisgl-server-", suffix=".log")[1])
    env = {k: v for k, v in os.environ.items() if k != "MINISGL_API_KEY"}
    cmd = [sys.executable, "-m", "minisgl", "--port", str(port), *args]
    if api_key:
        cmd += ["--api-key", api_key] if "--api-key" not in args else []
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = RunningServer(proc, port, log_path, api_key)
    deadline = t0 + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode} during startup:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2.0).status_code == 200:
                server.startup_s = time.monotonic() - t0
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    server.stop()
    pytest.fail(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{server.log()}")


@pytest.fixture(scope="session")
def server() -> Iterator[RunningServer]:
    srv = start_server(*MAIN_SERVER_ARGS, api_key=API_KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def tokenizer():
    from minisgl.models.loader import resolve_model_path
    from minisgl.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_path(None))
