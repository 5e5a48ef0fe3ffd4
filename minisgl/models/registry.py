"""Model classes by HF ``architectures`` name, imported only when selected."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from minisgl.models.loader.errors import ModelLoadError

if TYPE_CHECKING:
    from minisgl.models.base import CausalLM

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("minisgl.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("minisgl.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("minisgl.models.qwen3", "Qwen3ForCausalLM"),
    "MistralForCausalLM": ("minisgl.models.mistral", "MistralForCausalLM"),
}

_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_architecture(architectures: Sequence[str] | None, model_type: str = "") -> str:
    """Pick the first supported name in ``architectures`` (or infer it from ``model_type``).

    Raises ModelLoadError naming the unsupported architecture and listing supported ones.
    """
    names = list(architectures or [])
    for name in names:
        if name in _MODELS:
            return name
    if not names and model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    shown = ", ".join(names) if names else f"model_type {model_type!r}"
    raise ModelLoadError(
        f"unsupported model architecture {shown}; "
        f"supported architectures: {', '.join(supported_architectures())}"
    )


def get_model_class(architecture: str) -> type[CausalLM]:
    """The model class registered for an HF architecture name."""
    if architecture not in _MODELS:
        resolve_architecture([architecture])
    module, attr = _MODELS[architecture]
    return getattr(importlib.import_module(module), attr)
