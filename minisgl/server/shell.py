"""``python -m minisgl --shell``: chat with the model in the terminal.

Replies stream as they are generated; the conversation is kept as chat history.
``/reset`` clears it, ``/exit`` (or Ctrl-D) quits, Ctrl-C stops the current reply.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from typing import Any

from minisgl.message import Reply, TokenizeMsg
from minisgl.sampling_params import SamplingParams
from minisgl.server.args import ServerArgs
from minisgl.server.backend import Backend
from minisgl.server.errors import ApiError
from minisgl.server.generation import Generation

MAX_REPLY_TOKENS = 512
HELP = "/reset clears the conversation, /exit quits, Ctrl-C stops a reply."


async def read_line(prompt: str) -> str | None:
    """``input()`` on a daemon thread (so a pending read never blocks exit); None at EOF."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def read() -> None:
        try:
            line: str | None = input(prompt)
        except (EOFError, KeyboardInterrupt):
            line = None
        loop.call_soon_threadsafe(lambda: future.done() or future.set_result(line))

    threading.Thread(target=read, daemon=True).start()
    return await future


class Shell:
    def __init__(self, backend: Backend, args: ServerArgs, out: Any = None) -> None:
        self.backend = backend
        self.args = args
        self.out = out or sys.stdout
        self.history: list[dict[str, str]] = []
        self.current: Generation | None = None
        self.params = SamplingParams(temperature=0.0, max_tokens=MAX_REPLY_TOKENS)
        self.quit = asyncio.Event()

    def interrupt(self) -> None:
        """Ctrl-C: stop the reply being generated, or quit at the prompt."""
        if self.current is not None:
            self.current.abort()
        else:
            self.quit.set()

    async def ask(self, text: str) -> str:
        """Send one user turn, stream the reply to ``out``, and return it."""
        self.history.append({"role": "user", "content": text})
        gen = Generation(self.backend, "shell", 1, 1)
        msg = TokenizeMsg(
            rids=gen.rids_of(0),
            params=[SamplingParams(**self.params.__dict__)],
            messages=list(self.history),
        )
        self.current = gen
        parts: list[str] = []
        try:
            await gen.submit([msg])
            async for _, event in gen.events():
                if isinstance(event, Reply) and event.error is not None:
                    raise ApiError.from_info(event.error)
                if isinstance(event, Reply) and event.text:
                    parts.append(event.text)
                    self.out.write(event.text)
                    self.out.flush()
        except ApiError as exc:
            self.history.pop()
            self.out.write(f"[error] {exc.message}\n")
            return ""
        finally:
            self.current = None
        self.out.write("\n")
        reply = "".join(parts)
        self.history.append({"role": "assistant", "content": reply})
        return reply

    async def command(self, line: str) -> bool:
        """Handle one input line; False means quit."""
        text = line.strip()
        if not text:
            return True
        if text in ("/exit", "/quit"):
            return False
        if text == "/reset":
            self.history.clear()
            self.out.write("(conversation cleared)\n")
            return True
        if text in ("/help", "/?"):
            self.out.write(HELP + "\n")
            return True
        await self.ask(text)
        return True


async def run_shell(backend: Backend, args: ServerArgs) -> None:
    shell = Shell(backend, args)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, shell.interrupt)
    print(f"minisgl shell: chatting with {args.model_name}. {HELP}", flush=True)
    quit_task = asyncio.ensure_future(shell.quit.wait())
    try:
        while True:
            reader = asyncio.ensure_future(read_line(">>> "))
            await asyncio.wait({reader, quit_task}, return_when=asyncio.FIRST_COMPLETED)
            if not reader.done():
                reader.cancel()
                break
            line = reader.result()
            if line is None or not await shell.command(line):
                break
    finally:
        quit_task.cancel()
        loop.remove_signal_handler(signal.SIGINT)
        print(flush=True)
