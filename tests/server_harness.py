"""Real ``python -m minisgl`` server processes for the end-to-end suites.

Shared by ``tests/integration`` and ``tests/reliability``. A server is a subprocess leading
its own session (process group) on a port it picks itself (``--port 0``; the port is read
from its "ready" log line), logging to a temporary file. ``stop`` sends SIGTERM, then
SIGKILL to whatever of the group is left, and reports what outlived SIGTERM.

Servers run with ``OMP_WAIT_POLICY=PASSIVE`` (unless set): on a shared, oversubscribed
machine spinning OpenMP threads make a CPU decode step several times slower.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 20.0
READY_LINE = re.compile(r"ready in ([\d.]+)s: serving .* at http://[^:]+:(\d+)")


# ---- processes -----------------------------------------------------------------------------


def _stat_fields(pid: int | str) -> list[str] | None:
    """``/proc/PID/stat`` after the command name (state first), or None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def process_group(pgid: int) -> dict[int, str]:
    """Live (non-zombie) processes of process group ``pgid`` and their kernel names."""
    out: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(entry.name)
        try:
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if fields is not None and int(fields[2]) == pgid and fields[0] != "Z":
            out[int(entry.name)] = comm
    return out


def wait_group_gone(pgid: int, timeout: float) -> dict[int, str]:
    """Wait until no process of the group lives; return the survivors at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        left = process_group(pgid)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def pid_alive(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition to ``{sample name with labels: value}``."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


# ---- servers -------------------------------------------------------------------------------


@dataclass
class Server:
    """One ``python -m minisgl`` subprocess, leader of its own process group."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    api_key: str | None
    port: int | None = None
    startup_s: float = 0.0
    started_at: float = field(default_factory=time.monotonic)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def workers(self) -> dict[int, str]:
        """The launcher's children (scheduler, tokenizer, detokenizer) by kernel name."""
        return {p: c for p, c in process_group(self.proc.pid).items() if c.startswith("minisgl-")}

    def worker_pid(self, comm: str) -> int:
        (pid,) = [p for p, c in self.workers().items() if c == comm]
        return pid

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> Server:
        """Wait for the ready line and a 200 from ``/health``; fail with the log otherwise."""
        deadline = self.started_at + timeout
        with httpx.Client(timeout=2.0) as http:
            while True:
                if self.proc.poll() is not None:
                    code = self.proc.returncode
                    pytest.fail(f"{self.name} server exited with {code}:\n{self.log()}")
                if self.port is None:
                    m = READY_LINE.search(self.log())
                    if m:
                        self.startup_s = float(m.group(1))
                        self.port = int(m.group(2))
                if self.port is not None:
                    try:
                        if http.get(f"{self.url}/health").status_code == 200:
                            return self
                    except httpx.HTTPError:
                        pass
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        self.stop()
        pytest.fail(f"{self.name} server not healthy after {timeout}s:\n{self.log()}")

    def stop(self) -> dict[int, str]:
        """SIGTERM the launcher, then SIGKILL whatever of its group is left.

        Returns the processes that were still alive after SIGTERM and the grace period.
        """
        pgid = self.proc.pid
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        stragglers = wait_group_gone(pgid, 5.0)
        if stragglers or self.proc.poll() is None:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(5)
            wait_group_gone(pgid, 5.0)
        return stragglers


def launch(*args: str, name: str = "server") -> Server:
    """Start ``python -m minisgl --port 0 ARGS`` without waiting for it (see ``wait_ready``).

    The API key, if any, is taken from ``--api-key`` in ``args``; ``MINISGL_API_KEY`` from the
    environment is not passed on.
    """
    log_fd, log_name = tempfile.mkstemp(prefix=f"minisgl-{name}-", suffix=".log")
    env = {k: v for k, v in os.environ.items() if k != "MINISGL_API_KEY"}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    proc = subprocess.Popen(
        [sys.executable, "-m", "minisgl", "--port", "0", *args],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log_fd,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    os.close(log_fd)
    api_key = args[args.index("--api-key") + 1] if "--api-key" in args else None
    return Server(name, proc, Path(log_name), api_key)


def start_server(*args: str, name: str = "server") -> Server:
    """``launch`` and wait until it serves."""
    return launch(*args, name=name).wait_ready()
