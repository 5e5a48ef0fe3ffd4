"""Tokenization (chat templates, plain prompts) and streaming detokenization with stop strings."""

from __future__ import annotations

from minisgl.tokenizer.chat import encode_chat, encode_text, render_chat, validate_messages
from minisgl.tokenizer.detokenizer import IncrementalDetokenizer
from minisgl.tokenizer.loader import load_tokenizer
from minisgl.tokenizer.stop import StopMatcher

__all__ = [
    "IncrementalDetokenizer",
    "StopMatcher",
    "encode_chat",
    "encode_text",
    "load_tokenizer",
    "render_chat",
    "validate_messages",
]
