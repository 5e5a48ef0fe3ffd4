"""Real ``python -m minisgl`` servers for the reliability suite, and the suite's counters.

Every server is a subprocess in its own session (process group) on a port it picked itself
(``--port 0``; the port is read from its "ready" log line). Servers are launched together as
soon as the session starts (model loading overlaps), then each fixture waits for ``/health``.
Teardown sends SIGTERM, then SIGKILL to the whole group, and fails if any process of the
group survives.

Server kinds:

``main``      radix cache, API key, 64 KiB body limit, small context and chunked prefill;
              shared by the input, streaming, disconnect and burst modules.
``pressure``  a deliberately small KV pool and an in-flight cap, for exhaustion,
              never-fitting prompts and the full queue.
``fault``     one fresh server per fault test (SIGKILL, SIGTERM), prelaunched in parallel.
"""

from __future__ import annotations

import json
import math
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

REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m"
API_KEY = "reliability-key"
STARTUP_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 20.0

MAIN_MAX_SEQ_LEN = 1024
MAIN_MAX_BODY = 64 * 1024
MAIN_MAX_RUNNING = 64
PRESSURE_PAGES = 640
PRESSURE_MAX_RUNNING = 64
PRESSURE_MAX_QUEUED = 8
PRESSURE_MAX_SEQ_LEN = 2048

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
        "256",
        "--num-pages",
        "16384",
        "--debug-invariant",
    ),
    "pressure": (
        "--num-pages",
        str(PRESSURE_PAGES),
        "--max-seq-len",
        str(PRESSURE_MAX_SEQ_LEN),
        "--max-running-requests",
        str(PRESSURE_MAX_RUNNING),
        "--max-queued-requests",
        str(PRESSURE_MAX_QUEUED),
        "--debug-invariant",
    ),
    "fault": ("--num-pages", "2048", "--max-seq-len", "512", "--debug-invariant"),
}
FIXTURE_KIND = {"main_server": "main", "pressure_server": "pressure", "fault_server": "fault"}


# ---- counters ------------------------------------------------------------------------------


@dataclass
class SuiteStats:
    """What the suite did, printed at the end of the run."""

    requests: int = 0
    outcomes: Counter = field(default_factory=Counter)
    disconnect_to_free_s: list[float] = field(default_factory=list)
    notes: dict[str, object] = field(default_factory=dict)

    def p99_ms(self) -> float | None:
        xs = sorted(self.disconnect_to_free_s)
        if not xs:
            return None
        return 1000 * xs[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)]


STATS = SuiteStats()


def _count_request(request: httpx.Request) -> None:
    STATS.requests += 1


async def _acount_request(request: httpx.Request) -> None:
    STATS.requests += 1


def http_client(timeout: float = 60.0, **kwargs) -> httpx.Client:
    """A counted synchronous client (use for every request of the suite)."""
    return httpx.Client(timeout=timeout, event_hooks={"request": [_count_request]}, **kwargs)


def async_client(timeout: float = 60.0, **kwargs) -> httpx.AsyncClient:
    """A counted asyncio client without a connection cap."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(
        timeout=timeout, limits=limits, event_hooks={"request": [_acount_request]}, **kwargs
    )


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        STATS.outcomes[report.outcome] += 1
    elif report.outcome == "failed":
        STATS.outcomes["error"] += 1
    elif report.when == "setup" and report.outcome == "skipped":
        STATS.outcomes["skipped"] += 1


def pytest_terminal_summary(terminalreporter) -> None:
    if not STATS.outcomes:
        return
    o = STATS.outcomes
    tried = o["passed"] + o["failed"]
    p99 = STATS.p99_ms()
    lines = [
        f"cases tried: {tried}",
        f"requests sent: {STATS.requests}",
        f"failures: {o['failed'] + o['error']}",
        f"skipped: {o['skipped']}",
        f"disconnect -> KV free samples: {len(STATS.disconnect_to_free_s)}",
        "p99 disconnect -> KV free: " + ("n/a" if p99 is None else f"{p99:.0f} ms"),
    ]
    lines += [f"{k}: {v}" for k, v in STATS.notes.items()]
    terminalreporter.write_sep("-", "minisgl reliability")
    for line in lines:
        terminalreporter.write_line(line)
    out = os.environ.get("MINISGL_RELIABILITY_REPORT")
    if out:
        data = {
            "cases_tried": tried,
            "requests_sent": STATS.requests,
            "failures": o["failed"] + o["error"],
            "disconnect_samples": len(STATS.disconnect_to_free_s),
            "p99_disconnect_to_free_ms": p99,
            **{k: v for k, v in STATS.notes.items()},
        }
        Path(out).write_text(json.dumps(data, indent=2))


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
    deadline = time.monotonic() + timeout
    while True:
        left = process_group(pgid)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


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
        return {p: c for p, c in process_group(self.proc.pid).items() if p != self.proc.pid}

    def worker_pid(self, name: str) -> int:
        (pid,) = [p for p, comm in self.workers().items() if comm == name]
        return pid

    def wait_ready(self) -> Server:
        deadline = self.started_at + STARTUP_TIMEOUT_S
        with http_client(timeout=2.0) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    pytest.fail(f"{self.kind} server exited with {self.proc.returncode}:\n{self.log()}")
                if self.port is None:
                    m = re.search(r"ready in [\d.]+s: serving .* at http://[^:]+:(\d+)", self.log())
                    if m:
                        self.port = int(m.group(1))
                if self.port is not None:
                    try:
                        if http.get(f"{self.url}/health").status_code == 200:
                            self.startup_s = time.monotonic() - self.started_at
                            return self
                    except httpx.HTTPError:
                        pass
                time.sleep(0.1)
        self.stop()
        pytest.fail(f"{self.kind} server not healthy after {STARTUP_TIMEOUT_S}s:\n{self.log()}")

    def stop(self) -> dict[int, str]:
        """SIGTERM, then SIGKILL to the whole group; returns processes that had to be killed
        after the grace period (ideally none)."""
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
    args = SERVER_ARGS[kind]
    cmd = [sys.executable, "-m", "minisgl", "--port", "0", *args]
    proc = subprocess.Popen(
        cmd,
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
    """Servers launched up front, handed out by kind."""

    def __init__(self) -> None:
        self.idle: dict[str, list[Server]] = {}
        self.all: list[Server] = []

    def prelaunch(self, kind: str, count: int = 1) -> None:
        for _ in range(count):
            srv = launch(kind)
            self.idle.setdefault(kind, []).append(srv)
            self.all.append(srv)

    def take(self, kind: str) -> Server:
        if not self.idle.get(kind):
            self.prelaunch(kind)
        return self.idle[kind].pop(0).wait_ready()

    def stop_all(self) -> None:
        for srv in self.all:
            srv.stop()
            srv.log_path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def farm(request: pytest.FixtureRequest) -> Iterator[ServerFarm]:
    needed: Counter = Counter()
    shared: set[str] = set()
    for item in request.session.items:
        for name in getattr(item, "fixturenames", ()):
            kind = FIXTURE_KIND.get(name)
            if kind == "fault":
                needed[kind] += 1
            elif kind is not None:
                shared.add(kind)
    f = ServerFarm()
    for kind in ("main", "pressure", "fault"):
        count = needed[kind] if kind == "fault" else int(kind in shared)
        if count:
            f.prelaunch(kind, count)
    try:
        yield f
    finally:
        f.stop_all()


def _check_log_clean(srv: Server) -> None:
    log = srv.log()
    bad = [
        line
        for line in log.splitlines()
        if "CRITICAL" in line or "invariant" in line.lower() or "Traceback" in line
    ]
    assert not bad, f"{srv.kind} server logged problems:\n" + "\n".join(bad[:20])


def _shared(farm: ServerFarm, kind: str) -> Iterator[Server]:
    srv = farm.take(kind)
    STATS.notes[f"{kind} server startup"] = f"{srv.startup_s:.1f} s"
    try:
        yield srv
    finally:
        left = srv.stop()
        text = srv.log()
        assert not left, f"{kind} server left processes after SIGTERM: {left}\n{text[-4000:]}"
        assert srv.proc.returncode == 0, f"{kind} exited {srv.proc.returncode}:\n{text[-4000:]}"
        _check_log_clean(srv)


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


# ---- helpers used by several modules --------------------------------------------------------


def read_metrics(http: httpx.Client, srv: Server) -> dict[str, float]:
    text = http.get(f"{srv.url}/metrics").text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def is_idle(m: dict[str, float]) -> bool:
    """Nothing queued, running or in flight, no radix lock held, every KV token free or
    evictable (the cache invariant at idle)."""
    return (
        m["minisgl_num_running_requests"] == 0
        and m["minisgl_num_queued_requests"] == 0
        and m["minisgl_num_inflight_requests"] == 0
        and m["minisgl_kv_protected_tokens"] == 0
        and m["minisgl_kv_private_tokens"] == 0
        and m["minisgl_kv_free_tokens"] + m["minisgl_kv_evictable_tokens"]
        == m["minisgl_kv_total_tokens"]
        and m["minisgl_kv_total_tokens"] > 0
    )


def wait_idle(srv: Server, timeout: float = 30.0, poll_s: float = 0.02) -> dict[str, float]:
    """Poll /metrics until :func:`is_idle`; fail with the last snapshot at the deadline."""
    deadline = time.monotonic() + timeout
    with http_client(timeout=5.0) as http:
        while True:
            m = read_metrics(http, srv)
            if is_idle(m):
                return m
            if time.monotonic() > deadline:
                gauges = {k: v for k, v in m.items() if "bucket" not in k}
                pytest.fail(f"server not idle after {timeout}s: {gauges}")
            time.sleep(poll_s)


def finished_total(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith("minisgl_requests_total{"))


def sse_events(lines) -> Iterator[dict | str]:
    """Parsed ``data:`` payloads of an SSE line iterator (``"[DONE]"`` stays a string)."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        yield data if data == "[DONE]" else json.loads(data)
