"""Model location and weights: local HF dirs, GGUF files, the built-in default, Hub ids."""

from __future__ import annotations

from minisgl.models.loader.errors import ModelLoadError
from minisgl.models.loader.resolve import DEFAULT_MODEL, load_generation_eos, resolve_model_path
from minisgl.models.loader.safetensors_io import iter_safetensors, safetensors_files

__all__ = [
    "DEFAULT_MODEL",
    "ModelLoadError",
    "iter_safetensors",
    "load_generation_eos",
    "resolve_model_path",
    "safetensors_files",
]
