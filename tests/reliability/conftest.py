"""Real ``python -m minisgl`` servers for the reliability suite, and its end-of-run summary.

Every server is a subprocess leading its own session (process group), on a port it picked
itself (``--port 0``; the port is read from its "ready" log line). The shared servers, and
the first per-test fault server, are launched together when the first test needs a server,
so model loading overlaps; each fixture then waits for ``/health``. Teardown sends SIGTERM,
then SIGKILL to the whole group, and fails if any process of the group outlived SIGTERM.

Server kinds:

``main``      radix cache, API key, 64 KiB body limit, 1024-token context, 256-token prefill
              chunks; shared by the input, streaming, disconnect and burst modules.
``pressure``  a deliberately small KV pool (640 tokens in pages of 4) and an in-flight cap
              (64 running + 8 queued), for exhaustion, never-fitting prompts and the full
              queue.
``fault``     a fresh server per fault test (SIGKILL, SIGTERM), all launched at the start
              when memory allows (else one ahead of need).

Servers run with ``OMP_WAIT_POLICY=PASSIVE`` (unless set): on a shared, oversubscribed
machine spinning OpenMP threads make a CPU decode step several times slower. All run with
``--debug-invariant``; a shared server whose log shows a broken invariant, a
critical message or a traceback fails the run at teardown.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.reliability.support import STATS, http_client

REPO = Path(__file__).resolve().parents[2]
API_KEY = "reliability-key"
STARTUP_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 20.0
SERVER_MEMORY_BYTES = 2 << 30

MAIN_MAX_SEQ_LEN = 1024
MAIN_MAX_BODY = 64 * 1024
MAIN_MAX_RUNNING = 64
MAIN_PREFILL_CHUNK = 256
PRESSURE_KV_TOKENS = 640
PRESSURE_PAGE_SIZE = 4
PRESSURE_MAX_RUNNING = 64
PRESSURE_MAX_QUEUED = 8
FAULT_MAX_SEQ_LEN = 512

SERVER_ARGS: dict[str, tuple[str, ...]] = {
    "main": (
        "--api-key",
        API_KEY,
        "--max-body-bytes",
        str(MAIN_MAX_BODY),
        "--max-seq-len",
        str(MAIN_MAX_SEQ_LEN),
        "--max-running-requests",
        str(MAIN_MAX_RUNNING),
        "--max-prefill-length",
        str(MAIN_PREFILL_CHUNK),
        "--num-pages",
        "16384",
        "--debug-invariant",
    ),
    "pressure": (
        "--page-size",
        str(PRESSURE_PAGE_SIZE),
        "--num-pages",
        str(PRESSURE_KV_TOKENS // PRESSURE_PAGE_SIZE),
        "--max-seq-len",
        "2048",
        "--max-running-requests",
        str(PRESSURE_MAX_RUNNING),
        "--max-queued-requests",
        str(PRESSURE_MAX_QUEUED),
        "--debug-invariant",
    ),
    "fault": ("--num-pages", "2048", "--max-seq-len", str(FAULT_MAX_SEQ_LEN), "--debug-invariant"),
}
READY_LINE = re.compile(r"ready in ([\d.]+)s: serving .* at http://[^:]+:(\d+)")
FIXTURE_KIND = {"main_server": "main", "pressure_server": "pressure", "fault_server": "fault"}


# ---- summary -------------------------------------------------------------------------------


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "tests/reliability/" not in report.nodeid.replace("\\", "/"):
        return
    if report.when == "call":
        STATS.outcomes[report.outcome] += 1
    elif report.outcome == "failed":
        STATS.outcomes["error"] += 1
    elif report.outcome == "skipped":
        STATS.outcomes["skipped"] += 1


def pytest_terminal_summary(terminalreporter) -> None:
    o = STATS.outcomes
    if not o:
        return
    tried = o["passed"] + o["failed"]
    p99 = STATS.p99_ms()
    report = {
        "cases tried": tried,
        "requests sent": STATS.requests,
        "failures": o["failed"] + o["error"],
        "skipped": o["skipped"],
        "disconnect -> KV free samples": len(STATS.disconnect_to_free_s),
        "p99 disconnect -> KV free (ms)": None if p99 is None else round(p99, 1),
        **STATS.notes,
    }
    terminalreporter.write_sep("-", "minisgl reliability")
    for k, v in report.items():
        terminalreporter.write_line(f"{k}: {v}")
    out = os.environ.get("MINISGL_RELIABILITY_REPORT")
    if out:
        Path(out).write_text(json.dumps(report, indent=2, default=str))


# ---- processes -----------------------------------------------------------------------------


def process_group(pgid: int) -> dict[int, str]:
    """Live (non-zombie) processes of process group ``pgid`` and their kernel names."""
    out: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
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


def mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class Server:
    """One ``python -m minisgl`` subprocess, leader of its own process group."""

    kind: str
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

    def worker_pid(self, name: str) -> int:
        (pid,) = [p for p, comm in self.workers().items() if comm == name]
        return pid

    def wait_ready(self) -> Server:
        deadline = self.started_at + STARTUP_TIMEOUT_S
        with http_client(timeout=2.0) as http:
            while True:
                if self.proc.poll() is not None:
                    code = self.proc.returncode
                    pytest.fail(f"{self.kind} server exited with {code}:\n{self.log()}")
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
        pytest.fail(f"{self.kind} server not healthy after {STARTUP_TIMEOUT_S}s:\n{self.log()}")

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


def launch(kind: str) -> Server:
    log_fd, log_name = tempfile.mkstemp(prefix=f"minisgl-rel-{kind}-", suffix=".log")
    env = {k: v for k, v in os.environ.items() if k != "MINISGL_API_KEY"}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    args = SERVER_ARGS[kind]
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
    return Server(kind, proc, Path(log_name), api_key)


class ServerFarm:
    """Servers launched ahead of need and handed out by kind.

    Fault servers (one per test) are launched together when memory allows
    (``SERVER_MEMORY_BYTES`` of available memory each), otherwise one ahead of need.
    """

    def __init__(self, fault_needed: int) -> None:
        self.idle: dict[str, list[Server]] = {}
        self.all: list[Server] = []
        self.fault_to_launch = fault_needed

    def prelaunch(self, kind: str) -> None:
        if kind == "fault":
            self.fault_to_launch -= 1
        srv = launch(kind)
        self.idle.setdefault(kind, []).append(srv)
        self.all.append(srv)

    def prelaunch_faults(self, at_least: int) -> None:
        """Launch ``at_least`` fault servers, and more while memory allows (servers still
        booting have not taken their share yet, so it is subtracted for them)."""
        booting = sum(1 for srv in self.all if srv.port is None and srv.proc.poll() is None)
        spare = mem_available() // SERVER_MEMORY_BYTES - booting - 1
        for _ in range(min(self.fault_to_launch, max(at_least, spare))):
            self.prelaunch("fault")

    def take(self, kind: str) -> Server:
        if not self.idle.get(kind):
            self.prelaunch(kind)
        srv = self.idle[kind].pop(0)
        if kind == "fault" and not self.idle.get("fault"):
            self.prelaunch_faults(at_least=1)
        return srv.wait_ready()

    def stop_all(self) -> None:
        keep = STATS.outcomes["failed"] + STATS.outcomes["error"] > 0
        for srv in self.all:
            srv.stop()
            if keep:
                STATS.notes[f"log of {srv.kind} server {srv.proc.pid}"] = str(srv.log_path)
            else:
                srv.log_path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def farm(request: pytest.FixtureRequest) -> Iterator[ServerFarm]:
    kinds: Counter = Counter()
    for item in request.session.items:
        for name in getattr(item, "fixturenames", ()):
            if name in FIXTURE_KIND:
                kinds[FIXTURE_KIND[name]] += 1
    f = ServerFarm(kinds["fault"])
    for kind in ("main", "pressure"):
        if kinds[kind]:
            f.prelaunch(kind)
    f.prelaunch_faults(at_least=1)
    try:
        yield f
    finally:
        f.stop_all()


def problems_in_log(text: str) -> list[str]:
    return [
        line
        for line in text.splitlines()
        if "CRITICAL" in line or "invariant" in line.lower() or "Traceback" in line
    ]


def _shared(farm: ServerFarm, kind: str) -> Iterator[Server]:
    srv = farm.take(kind)
    STATS.notes[f"{kind} server startup (s)"] = round(srv.startup_s, 1)
    try:
        yield srv
    finally:
        left = srv.stop()
        text = srv.log()
        assert not left, f"{kind} server left processes after SIGTERM: {left}\n{text[-4000:]}"
        assert srv.proc.returncode == 0, f"{kind} exited {srv.proc.returncode}:\n{text[-4000:]}"
        bad = problems_in_log(text)
        assert not bad, f"{kind} server logged problems:\n" + "\n".join(bad[:20])


@pytest.fixture(scope="session")
def main_server(farm: ServerFarm) -> Iterator[Server]:
    yield from _shared(farm, "main")


@pytest.fixture(scope="session")
def pressure_server(farm: ServerFarm) -> Iterator[Server]:
    yield from _shared(farm, "pressure")


@pytest.fixture
def fault_server(farm: ServerFarm) -> Iterator[Server]:
    srv = farm.take("fault")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def tokenizer():
    from minisgl.models.loader import resolve_model_path
    from minisgl.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_path(None))
