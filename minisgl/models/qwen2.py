"""Qwen2ForCausalLM."""

from __future__ import annotations

from minisgl.models.base import CausalLM


class Qwen2ForCausalLM(CausalLM):
    """Qwen2 / Qwen2.5: bias on the q, k and v projections (``ModelConfig.qkv_bias``).

    The architecture-specific parts are flags of ``ModelConfig`` set by ``from_hf``;
    the layers themselves are the shared ones in ``minisgl.models.base``.
    """
