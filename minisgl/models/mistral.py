"""MistralForCausalLM."""

from __future__ import annotations

from minisgl.models.base import CausalLM


class MistralForCausalLM(CausalLM):
    """Mistral: the Llama decoder; its sliding window caps the engine's max sequence length.

    The architecture-specific parts are flags of ``ModelConfig`` set by ``from_hf``;
    the layers themselves are the shared ones in ``minisgl.models.base``.
    """
