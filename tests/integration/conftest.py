"""Real ``python -m minisgl`` servers for end-to-end tests (see ``tests/server_harness.py``).

``server`` (session scope) is the default model with the radix cache, an API key and a small
in-flight limit; ``start_server`` starts more (e.g. ``--cache naive``) for tests that need
them. Servers are stopped with SIGTERM at teardown.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.server_harness import Server, start_server

API_KEY = "test-key"
MAX_RUNNING = 40
MAX_QUEUED = 8
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


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    srv = start_server(*MAIN_SERVER_ARGS, name="integration")
    yield srv
    srv.stop()
