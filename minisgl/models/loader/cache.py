"""The on-disk conversion cache: atomic directory builds guarded by a file lock."""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager

MARKER_FILE = "minisgl_source.json"


def cache_root() -> pathlib.Path:
    """$MINISGL_CACHE, or ~/.cache/minisgl."""
    return pathlib.Path(os.environ.get("MINISGL_CACHE") or "~/.cache/minisgl").expanduser()


def is_complete(target: pathlib.Path) -> bool:
    """Whether ``target`` is a finished cache entry (the marker is written last, before rename)."""
    return (target / MARKER_FILE).is_file()


@contextmanager
def file_lock(lock_path: pathlib.Path) -> Iterator[None]:
    """An exclusive advisory lock (fcntl.flock) held for the duration of the block."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as fd:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)


def build_once(
    target: pathlib.Path, build: Callable[[pathlib.Path], None], source: dict[str, object]
) -> pathlib.Path:
    """Return ``target``, building it first with ``build(tmp_dir)`` if it is not cached yet.

    The build writes into a temporary sibling directory which is renamed onto ``target`` only
    when complete, so an interrupted build never leaves a half entry. Concurrent callers
    serialize on a lock file; the loser finds the winner's finished entry. Leftovers of a
    killed build are removed by the next one.
    """
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / f".{target.name}.lock"):
        if is_complete(target):
            return target
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build(tmp)
            _make_readable(tmp)
            (tmp / MARKER_FILE).write_text(json.dumps(source, indent=2) + "\n")
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _make_readable(directory: pathlib.Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for path in directory.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
