"""Running a worker as a child of the launcher: readiness, failure reports, parent watch."""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from minisgl.message import ConfigMsg, FailedMsg, ProgressMsg, ReadyMsg, decode, encode

PR_SET_NAME = 15
PR_SET_PDEATHSIG = 1
logger = logging.getLogger(__name__)


class ParentLink:
    """A child's end of its startup pipe, and a way to tell whether the launcher still lives."""

    def __init__(self, name: str, conn: Connection, parent_pid: int) -> None:
        self.name = name
        self._conn = conn
        self._parent_pid = parent_pid

    def ready(self, **info: Any) -> None:
        self._conn.send_bytes(encode(ReadyMsg(self.name, info)))

    def progress(self, **info: Any) -> None:
        self._conn.send_bytes(encode(ProgressMsg(self.name, info)))

    def failed(self, error: str) -> None:
        try:
            self._conn.send_bytes(encode(FailedMsg(self.name, error)))
        except OSError:
            pass

    def wait_config(self) -> ConfigMsg:
        """Block until the launcher sends what the scheduler found out (model path, limits)."""
        while True:
            if self._conn.poll(0.5):
                msg = decode(self._conn.recv_bytes())
                if isinstance(msg, ConfigMsg):
                    return msg
            elif not self.parent_alive():
                raise SystemExit(0)

    def parent_alive(self) -> bool:
        return os.getppid() == self._parent_pid


def process_title(name: str) -> str:
    """The 15-byte kernel name (``/proc/PID/comm``, shown by ps/top) of worker ``name``."""
    short = name.replace("scheduler-", "sched-").replace("detokenizer", "detok")
    return f"minisgl-{short.replace('tokenizer', 'tok')}"[:15]


def _set_up_linux_process(name: str) -> None:
    """Name the process, and ask Linux to SIGKILL it when the launcher dies (no orphans)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(process_title(name).encode()), 0, 0, 0)
    except (OSError, AttributeError):
        pass


SIGTERM_EXIT_CODE = 128 + signal.SIGTERM
"""A child's exit code after SIGTERM, so the launcher can tell a stop from a crash."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(SIGTERM_EXIT_CODE)


def configure_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s [{name}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )


def child_main(
    name: str,
    conn: Connection,
    parent_pid: int,
    log_level: str,
    target: Callable[..., None],
    *args: Any,
) -> None:
    """Entry point of every child: ``target(link, *args)`` with failures reported upstream.

    The child ignores SIGINT (the launcher decides when to stop on Ctrl-C) and exits cleanly
    on SIGTERM, with ``SIGTERM_EXIT_CODE``. An exception is sent to the launcher with its
    traceback, then exit code 1.
    The exit skips interpreter teardown (``os._exit``): the targets close their sockets
    themselves, and tearing down torch/transformers can take seconds.
    """
    _set_up_linux_process(name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    configure_logging(log_level, name)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    link = ParentLink(name, conn, parent_pid)
    code = 0
    try:
        if link.parent_alive():
            target(link, *args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0
    except BaseException as exc:
        detail = traceback.format_exc()
        logger.error("%s failed: %s", name, exc)
        link.failed(f"{type(exc).__name__}: {exc}\n{detail}")
        code = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
