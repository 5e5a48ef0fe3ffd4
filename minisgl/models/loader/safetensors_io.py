"""Reading HF safetensors checkpoints (single file or sharded with an index)."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator

import torch
from safetensors import safe_open

from minisgl.models.loader.errors import ModelLoadError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The safetensors files of a checkpoint, in a stable order.

    ``path`` may be a ``.safetensors`` file, or a directory with ``model.safetensors.index.json``
    (sharded), ``model.safetensors`` (single), or otherwise any ``*.safetensors`` files.
    Raises ModelLoadError when a file is missing or the index is unreadable.
    """
    path = pathlib.Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ModelLoadError(f"model path {path} does not exist")
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"corrupt safetensors index {index}: {e}") from e
        files = [path / name for name in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"safetensors shard(s) listed in {index} are missing: {missing}")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no safetensors weights found in {path}")
    return files


def iter_safetensors(path: pathlib.Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, tensor) pairs of a single or sharded safetensors checkpoint.

    Files are memory-mapped and tensors yielded one at a time (CPU tensors in the stored dtype).
    A missing, truncated or corrupt file raises ModelLoadError naming that file.
    """
    for file in safetensors_files(path):
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as e:
            raise ModelLoadError(f"corrupt or unreadable safetensors file {file}: {e}") from e
        with handle as f:
            for name in f.keys():
                try:
                    tensor = f.get_tensor(name)
                except Exception as e:
                    raise ModelLoadError(
                        f"corrupt safetensors file {file} (tensor {name!r}): {e}"
                    ) from e
                yield name, tensor
