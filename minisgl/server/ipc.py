"""ZeroMQ addresses and sockets of one launch.

Every receiving side binds a PULL socket at its own ``ipc://`` path inside a private
per-launch directory; senders connect PUSH sockets to it::

    api       <- tokenizer (accepted / errors), detokenizer (text), scheduler 0 (stats)
    tokenizer <- api (tokenize, abort)
    scheduler <- tokenizer (requests, aborts), detokenizer (stop-string matches)
    detok     <- scheduler 0 (token ids, once per step)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import zmq

ENDPOINTS = ("api", "tokenizer", "scheduler", "detokenizer")
PREFIX = "minisgl-"
OWNER_FILE = "launcher.pid"


@dataclass(frozen=True)
class IpcPaths:
    root: str

    @classmethod
    def create(cls) -> IpcPaths:
        """A fresh private directory (mode 0700) for this launch's sockets.

        It records the launcher's pid; directories left behind by launchers that were killed
        outright (SIGKILL leaves no chance to clean up) are removed on the way.
        """
        remove_stale_dirs()
        root = tempfile.mkdtemp(prefix=PREFIX)
        with open(os.path.join(root, OWNER_FILE), "w") as f:
            f.write(str(os.getpid()))
        return cls(root)

    def addr(self, endpoint: str) -> str:
        if endpoint not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {endpoint!r}")
        return f"ipc://{os.path.join(self.root, endpoint)}"

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def remove_stale_dirs() -> None:
    """Remove socket directories whose launcher no longer runs."""
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        path = os.path.join(tmp, name)
        if not name.startswith(PREFIX) or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, OWNER_FILE)) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if not _pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def bind_pull(ctx: zmq.Context, paths: IpcPaths, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(paths.addr(endpoint))
    return sock


def connect_push(ctx: zmq.Context, paths: IpcPaths, endpoint: str) -> zmq.Socket:
    """A sender that never blocks and never drops (unbounded queue)."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(paths.addr(endpoint))
    return sock


def recv_all(sock: zmq.Socket, timeout_ms: int) -> list[bytes]:
    """Wait up to ``timeout_ms`` for a frame, then drain what else is queued, without waiting."""
    frames: list[bytes] = []
    if timeout_ms > 0 and not sock.poll(timeout_ms, zmq.POLLIN):
        return frames
    while True:
        try:
            frames.append(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            return frames


@contextlib.contextmanager
def zmq_context() -> Iterator[zmq.Context]:
    """A context whose sockets are all closed on exit, so interpreter shutdown never blocks
    in ``zmq_ctx_term`` waiting for a socket someone forgot."""
    ctx = zmq.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)
