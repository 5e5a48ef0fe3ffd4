"""Turning a ``--model`` argument into a local Hugging Face style directory."""

from __future__ import annotations

import json
import os
import pathlib
import re

from minisgl.models.loader.default_model import DEFAULT_MODEL, default_model_path
from minisgl.models.loader.errors import ModelLoadError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?$")


def resolve_model_path(model: str | os.PathLike[str] | None) -> pathlib.Path:
    """Return a local HF-style directory with config.json, tokenizer files and safetensors.

    - ``None`` or ``"smollm2-135m"``: the built-in default, converted once into the cache.
    - an existing directory: itself (it must hold config.json; a directory holding a single
      ``.gguf`` file and no config.json is treated as that file).
    - an existing ``.gguf`` file: converted once into the cache (keyed by path, size, mtime).
    - a path that does not exist (absolute, relative with ``./``, ``~``, or ending in .gguf):
      ModelLoadError "model path ... does not exist".
    - anything else that looks like ``org/name``: a Hugging Face Hub id (downloaded when the
      network allows).

    Raises ModelLoadError with a one-line message naming the problem.
    """
    if model is None or str(model) == DEFAULT_MODEL:
        return default_model_path()
    text = os.fspath(model)
    if not text.strip():
        raise ModelLoadError("model name is empty")
    path = pathlib.Path(text).expanduser()
    if path.is_dir():
        return _resolve_dir(path)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            from minisgl.models.loader.gguf_convert import gguf_to_cached_dir

            return gguf_to_cached_dir(path)
        raise ModelLoadError(
            f"model path {path} is a file but not a .gguf file; "
            "pass a Hugging Face model directory or a .gguf file"
        )
    if _looks_like_path(text):
        raise ModelLoadError(f"model path {text} does not exist")
    from minisgl.models.loader.hub import download_from_hub

    return download_from_hub(text)


def _resolve_dir(path: pathlib.Path) -> pathlib.Path:
    if (path / "config.json").is_file():
        return path.absolute()
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        from minisgl.models.loader.gguf_convert import gguf_to_cached_dir

        return gguf_to_cached_dir(ggufs[0])
    if ggufs:
        names = ", ".join(g.name for g in ggufs)
        raise ModelLoadError(
            f"model directory {path} has no config.json and several .gguf files "
            f"({names}); pass one of them"
        )
    raise ModelLoadError(f"model directory {path} has no config.json")


def _looks_like_path(text: str) -> bool:
    if text.startswith(("/", ".", "~")) or text.lower().endswith(".gguf"):
        return True
    if os.altsep and os.altsep in text:
        return True
    return _HUB_ID.match(text) is None


def _eos_ids(value: object) -> set[int]:
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, (list, tuple)):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def load_generation_eos(path: pathlib.Path) -> frozenset[int]:
    """End-of-sequence token ids of a model directory.

    The union of ``eos_token_id`` (an int or a list) in config.json (top level, or its
    ``text_config``) and in generation_config.json; a missing file contributes nothing.
    """
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        file = pathlib.Path(path) / name
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read {file}: {e}") from e
        if not isinstance(data, dict):
            continue
        ids |= _eos_ids(data.get("eos_token_id"))
        text_config = data.get("text_config")
        if isinstance(text_config, dict):
            ids |= _eos_ids(text_config.get("eos_token_id"))
    return frozenset(ids)
