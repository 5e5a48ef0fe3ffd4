"""minisgl: a small, fast, OpenAI-compatible LLM serving server."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from minisgl.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minisgl.llm import LLM

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from minisgl.llm import LLM

        return LLM
    raise AttributeError(name)
