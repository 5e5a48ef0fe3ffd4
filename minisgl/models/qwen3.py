"""Qwen3ForCausalLM."""

from __future__ import annotations

from minisgl.models.base import CausalLM


class Qwen3ForCausalLM(CausalLM):
    """Qwen3 (dense): per-head RMSNorm on q and k before rotary (``ModelConfig.qk_norm``).

    The architecture-specific parts are flags of ``ModelConfig`` set by ``from_hf``;
    the layers themselves are the shared ones in ``minisgl.models.base``.
    """
