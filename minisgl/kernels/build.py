"""Compile ``cpu_kernels.c`` once per machine into the cache directory and load it.

The shared library is keyed by a hash of the source, the compiler flags, the compiler's
version and the CPU's feature flags (it is built with ``-march=native``), and stored under
``$MINISGL_CACHE/kernels``. A machine without a C compiler gets ``None`` and the callers
keep their torch code paths.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess

from minisgl.models.loader.cache import build_once, cache_root

logger = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno")
DISABLE_ENV = "MINISGL_CPU_KERNELS"
"""Set to ``0`` to skip the compiled kernels (the torch paths are used instead)."""


def _cpu_flags() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernel library, building it on first use; None when unavailable."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    cc = _compiler()
    if cc is None:
        logger.warning("no C compiler found: CPU kernels disabled, using slower torch paths")
        return None
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, check=True
        ).stdout
        key = hashlib.sha256(
            "\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_flags()]).encode()
        ).hexdigest()[:16]

        def build(tmp: pathlib.Path) -> None:
            cmd = [cc, *FLAGS, "-o", str(tmp / "libminisgl_cpu.so"), str(SOURCE), "-lm"]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")

        target = build_once(cache_root() / "kernels" / key, build, {"source": SOURCE.name})
        return ctypes.CDLL(str(target / "libminisgl_cpu.so"))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        logger.warning("CPU kernels unavailable (%s); using slower torch paths", e)
        return None
