"""Real ``python -m minisgl`` servers for the reliability suite, and its end-of-run summary.

Servers are started with ``tests/server_harness.py`` (process group of their own, port chosen
by the server). The shared servers, and the first per-test fault server, are launched
together when the first test needs a server, so model loading overlaps; each fixture then
waits for ``/health``. Teardown sends SIGTERM, then SIGKILL to the whole group, and fails if
any process of the group outlived SIGTERM.

Server kinds:

``main``      radix cache, API key, 64 KiB body limit, 1024-token context, 256-token prefill
              chunks; shared by the input, streaming, disconnect and burst modules.
``pressure``  a deliberately small KV pool (640 tokens in pages of 4) and an in-flight cap
              (64 running + 8 queued), for exhaustion, never-fitting prompts and the full
              queue.
``fault``     a fresh server per fault test (SIGKILL, SIGTERM), all launched at the start
              when memory allows (else one ahead of need).

All run with ``--debug-invariant``; a shared server whose log shows a broken invariant, a
critical message or a traceback fails the run at teardown.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.support import STATS
from tests.server_harness import Server, launch

API_KEY = "reliability-key"
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
    p50, p99 = (STATS.disconnect_quantile_ms(q) for q in (0.5, 0.99))
    r = STATS.requests
    report = {
        "cases tried": tried,
        "requests sent": r["api"] + r["probe"],
        "requests sent: API calls / /health and /metrics probes": f"{r['api']} / {r['probe']}",
        "failures": o["failed"] + o["error"],
        "skipped": o["skipped"],
        "disconnect -> KV free: samples": len(STATS.disconnect_to_free_s),
        "disconnect -> KV free: p50 / p99 (ms)": None if p99 is None else f"{p50:.0f} / {p99:.0f}",
        **STATS.notes,
    }
    terminalreporter.write_sep("-", "minisgl reliability")
    for k, v in report.items():
        terminalreporter.write_line(f"{k}: {v}")
    out = os.environ.get("MINISGL_RELIABILITY_REPORT")
    if out:
        Path(out).write_text(json.dumps(report, indent=2, default=str))


# ---- servers -------------------------------------------------------------------------------


def mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


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
        srv = launch(*SERVER_ARGS[kind], name=kind)
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
                STATS.notes[f"log of {srv.name} server {srv.proc.pid}"] = str(srv.log_path)
            else:
                srv.log_path.unlink(missing_ok=True)


@pytest.fixture(scope="package")
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


@pytest.fixture(scope="package")
def main_server(farm: ServerFarm) -> Iterator[Server]:
    yield from _shared(farm, "main")


@pytest.fixture(scope="package")
def pressure_server(farm: ServerFarm) -> Iterator[Server]:
    yield from _shared(farm, "pressure")


@pytest.fixture
def fault_server(farm: ServerFarm) -> Iterator[Server]:
    srv = farm.take("fault")
    try:
        yield srv
    finally:
        srv.stop()
