"""LlamaForCausalLM."""

from __future__ import annotations

from minisgl.models.base import CausalLM


class LlamaForCausalLM(CausalLM):
    """Llama 2/3, SmolLM and other Llama-architecture models.

    Optional attention / MLP bias; rope scaling of type llama3 or linear.

    The architecture-specific parts are flags of ``ModelConfig`` set by ``from_hf``;
    the layers themselves are the shared ones in ``minisgl.models.base``.
    """
