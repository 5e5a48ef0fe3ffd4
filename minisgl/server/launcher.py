"""``python -m minisgl``: start the workers, wait until they are ready, serve, supervise.

::

    launcher (this process: API server + supervisor)
     ├── scheduler rank 0 .. tp-1   (engine, KV cache, scheduling)
     ├── tokenizer                  (prompts -> ids, context-length check)
     └── detokenizer                (ids -> text, stop strings)

The API server runs in the launcher itself: replies reach the HTTP handlers without another
hop, supervision shares its event loop, and one process fewer competes for small machines.
It never imports torch or transformers, so it listens within a second or two and answers
``/health`` with 503 "starting" until every worker is ready.

Children talk over ZeroMQ ``ipc://`` sockets in a private temporary directory; each reports
readiness (or its startup error) on a pipe. A child that dies later makes ``/health`` answer
503, ends every request, and stops the launcher with exit code 1. SIGINT/SIGTERM stop
accepting, end the requests in flight, and terminate every child.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from minisgl.message import ConfigMsg, FailedMsg, ProgressMsg, ReadyMsg, decode, encode
from minisgl.server.args import ServerArgs, parse_args
from minisgl.server.ipc import IpcPaths
from minisgl.server.process import SIGTERM_EXIT_CODE, child_main, configure_logging

logger = logging.getLogger("minisgl.launcher")

STOP_TIMEOUT_S = 5.0
DEATH_GRACE_S = 1.0


class StartupError(RuntimeError):
    def __init__(self, name: str, error: str, exitcode: int | None) -> None:
        super().__init__(f"{name} failed to start: {error}")
        self.name = name
        self.error = error
        self.exitcode = exitcode


@dataclass
class Child:
    name: str
    process: Any
    conn: Connection
    info: dict[str, Any] = field(default_factory=dict)
    ready: bool = False
    configured: bool = False

    def read_failure(self) -> str | None:
        """The error a dead child sent before exiting, if any."""
        try:
            while self.conn.poll(0):
                msg = decode(self.conn.recv_bytes())
                if isinstance(msg, FailedMsg):
                    return msg.error
        except (EOFError, OSError, ValueError):
            pass
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bind_http_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket first, so a busy port fails before any model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


class Launcher:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.log_level = "warning" if args.shell and args.log_level == "info" else args.log_level
        self.children: list[Child] = []
        self.paths: IpcPaths | None = None
        self.exit_code = 0
        self.started_at = time.monotonic()
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = os.pipe()

    # ---- children --------------------------------------------------------------------
    def _spawn(self, name: str, target: Any, *args: Any) -> None:
        ctx = mp.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        proc = ctx.Process(
            target=child_main,
            args=(name, child_conn, os.getpid(), self.log_level, target, *args),
            name=f"minisgl-{name}",
            daemon=True,
        )
        proc.start()
        child_conn.close()
        logger.debug("started %s (pid %d)", name, proc.pid)
        self.children.append(Child(name, proc, parent_conn))

    def start_children(self) -> None:
        from minisgl.scheduler.worker import run_scheduler
        from minisgl.server.detokenizer_worker import run_detokenizer
        from minisgl.server.tokenizer_worker import run_tokenizer

        assert self.paths is not None
        master_port = _free_port() if self.args.tp > 1 else 0
        for rank in range(self.args.tp):
            self._spawn(
                f"scheduler-{rank}", run_scheduler, self.paths, self.args, rank, master_port
            )
        self._spawn("tokenizer", run_tokenizer, self.paths)
        self._spawn("detokenizer", run_detokenizer, self.paths)

    def wait_ready(self) -> dict[str, Any]:
        """Block until every child is ready; the scheduler's facts are sent to the others.

        Runs on a worker thread while the HTTP server already answers (503 "starting");
        returns early, with no facts, once the launcher is stopping.
        """
        facts: dict[str, Any] = {}
        while not all(c.ready for c in self.children) and not self._stopping.is_set():
            pending = [c for c in self.children if not c.ready]
            handles = [c.conn for c in pending] + [c.process.sentinel for c in pending]
            for handle in wait(handles, timeout=1.0):
                child = next(c for c in pending if handle is c.conn or handle == c.process.sentinel)
                if handle is child.conn:
                    try:
                        msg = decode(child.conn.recv_bytes())
                    except (EOFError, OSError):
                        msg = None
                    if isinstance(msg, ProgressMsg):
                        if child.name == "scheduler-0" and "model_path" in msg.info:
                            self._send_config(ConfigMsg(msg.info["model_path"]))
                        continue
                    if isinstance(msg, ReadyMsg):
                        child.ready, child.info = True, msg.info
                        if child.name == "scheduler-0":
                            facts = msg.info
                            self._send_config(
                                ConfigMsg(
                                    facts["model_path"], facts["max_seq_len"], facts["vocab_size"]
                                )
                            )
                        continue
                    if isinstance(msg, FailedMsg):
                        child.process.join(STOP_TIMEOUT_S)
                        raise StartupError(child.name, msg.error, child.process.exitcode)
                child.process.join(STOP_TIMEOUT_S)
                error = child.read_failure() or "exited without a message"
                raise StartupError(child.name, error, child.process.exitcode)
        return facts

    def _send_config(self, config: ConfigMsg) -> None:
        """Model path (and, once known, limits) to the tokenizer; the path to the detokenizer."""
        for child in self.children:
            if child.name == "tokenizer" or (child.name == "detokenizer" and not child.configured):
                child.conn.send_bytes(encode(config))
                child.configured = True

    def stop_children(self) -> None:
        alive = [c for c in self.children if c.process.is_alive()]
        for c in alive:
            c.process.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for c in alive:
            c.process.join(max(deadline - time.monotonic(), 0.0))
            if c.process.is_alive():
                logger.warning("%s did not stop in time; killing it", c.name)
                c.process.kill()
                c.process.join(1.0)
        for c in self.children:
            c.conn.close()

    # ---- supervision -----------------------------------------------------------------
    def _supervise(self, on_death: Any) -> None:
        """Thread: report the first child that dies while serving."""
        sentinels = {c.process.sentinel: c for c in self.children}
        while not self._stopping.is_set():
            ready = wait([*sentinels, self._wake_r])
            if self._stopping.is_set():
                return
            for handle in ready:
                child = sentinels.get(handle)
                if child is None:
                    continue
                child.process.join(1.0)
                error = child.read_failure() or "exited unexpectedly"
                on_death(child.name, child.process.exitcode, error)
                return

    def _stop_supervisor(self) -> None:
        self._stopping.set()
        os.write(self._wake_w, b"x")

    # ---- serving ---------------------------------------------------------------------
    async def serve(self, sock: socket.socket | None) -> int:
        """Serve (HTTP or shell) until a signal or a dead worker; 503 until workers are ready."""
        from minisgl.server.backend import ZmqBackend

        args = self.args
        assert self.paths is not None
        max_inflight = None
        if args.max_queued_requests is not None:
            max_inflight = args.max_running_requests + args.max_queued_requests
        backend = ZmqBackend(self.paths, max_inflight)
        backend.start()
        loop = asyncio.get_running_loop()
        stop_serving = asyncio.Event()
        server = None if args.shell else self._make_server(backend, loop)
        serving = asyncio.ensure_future(server.serve(sockets=[sock])) if server else None

        def on_death(name: str, exitcode: int | None, error: str) -> None:
            def handle() -> None:
                if exitcode in (SIGTERM_EXIT_CODE, -signal.SIGTERM):
                    # SIGTERM sent to the whole process group (systemd, `kill -- -PGID`,
                    # `timeout`): a stop request, not a crash.
                    logger.info("%s got SIGTERM; stopping", name)
                    stop_serving.set()
                    return
                first_line = error.strip().splitlines()[0] if error.strip() else error
                logger.error("%s died (exit code %s): %s", name, exitcode, error.strip())
                backend.fail(f"{name} exited with code {exitcode}: {first_line}")
                self.exit_code = 1
                loop.call_later(DEATH_GRACE_S, stop_serving.set)

            loop.call_soon_threadsafe(handle)

        try:
            ready = loop.run_in_executor(None, self.wait_ready)
            await asyncio.wait(
                {ready} | ({serving} if serving else set()), return_when=asyncio.FIRST_COMPLETED
            )
            if not ready.done():
                self._stopping.set()
                await asyncio.gather(ready, return_exceptions=True)
                return 0
            facts = ready.result()
            backend.set_ready(facts)
            threading.Thread(target=self._supervise, args=(on_death,), daemon=True).start()
            if server is None:
                from minisgl.server.shell import run_shell

                self._log_ready(facts, None)
                shell = asyncio.ensure_future(run_shell(backend, args))
                stopper = asyncio.ensure_future(stop_serving.wait())
                await asyncio.wait({shell, stopper}, return_when=asyncio.FIRST_COMPLETED)
                for task in (shell, stopper):
                    task.cancel()
                return self.exit_code
            while not server.started and not serving.done():
                await asyncio.sleep(0.02)
            self._log_ready(facts, sock)
            stopper = asyncio.ensure_future(stop_serving.wait())
            await asyncio.wait({serving, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            server.should_exit = True
            await serving
            return self.exit_code
        finally:
            self._stop_supervisor()
            if serving is not None and not serving.done():
                server.should_exit = True
                await asyncio.gather(serving, return_exceptions=True)
            backend.finish_all("abort")
            await backend.close()

    def _make_server(self, backend: Any, loop: Any) -> Any:
        import uvicorn

        from minisgl.server.api import ApiSettings, create_app

        args = self.args
        settings = ApiSettings(
            model_name=args.model_name,
            accepted_models=args.accepted_model_names,
            api_key=args.api_key,
            max_body_bytes=args.max_body_bytes,
        )
        config = uvicorn.Config(
            create_app(backend, settings),
            log_config=None,
            log_level=args.log_level,
            access_log=args.log_level == "debug",
            lifespan="off",
            timeout_graceful_shutdown=int(STOP_TIMEOUT_S),
            timeout_keep_alive=30,
        )

        def on_signal() -> None:
            loop.call_soon_threadsafe(backend.shut_down)

        return make_uvicorn_server(config, on_signal)

    def _log_ready(self, facts: dict[str, Any], sock: socket.socket | None) -> None:
        elapsed = time.monotonic() - self.started_at
        where = ""
        if sock is not None:
            host, port = sock.getsockname()[:2]
            where = f" at http://{host}:{port}"
        logger.info(
            "ready in %.1fs: serving %s%s (device %s, %s, context %s, KV %s tokens)",
            elapsed,
            self.args.model_name,
            where,
            facts.get("device"),
            facts.get("dtype"),
            facts.get("max_seq_len"),
            facts.get("kv_tokens"),
        )

    # ---- main ------------------------------------------------------------------------
    def run(self) -> int:
        args = self.args
        signal.signal(signal.SIGTERM, _raise_interrupt)
        sock = None
        try:
            if not args.shell:
                try:
                    sock = bind_http_socket(args.host, args.port)
                except OSError as exc:
                    logger.error("cannot listen on %s:%d: %s", args.host, args.port, exc)
                    return 1
            self.paths = IpcPaths.create()
            self.start_children()
            return asyncio.run(self.serve(sock))
        except StartupError as exc:
            logger.error("%s failed to start:\n%s", exc.name, exc.error.rstrip())
            return exc.exitcode if exc.exitcode not in (None, 0) else 1
        except KeyboardInterrupt:
            logger.info("interrupted; stopping")
            return 0
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            self.stop_children()
            if sock is not None:
                sock.close()
            if self.paths is not None:
                self.paths.remove()
            os.close(self._wake_r)
            os.close(self._wake_w)


def make_uvicorn_server(config: Any, on_signal: Any) -> Any:
    """uvicorn, except that a signal first ends the requests in flight and is not re-raised
    after shutdown (the launcher still has children to stop)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            on_signal()
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    return Server(config)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m minisgl``; returns the process exit code."""
    args = parse_args(argv)
    launcher = Launcher(args)
    configure_logging(launcher.log_level, "launcher")
    code = launcher.run()
    sys.stdout.flush()
    return code
