"""Messages between the launcher and its children over their startup pipes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minisgl.message.codec import register


@register
@dataclass
class ReadyMsg:
    """A child finished starting; ``info`` carries facts the launcher passes on."""

    name: str
    info: dict[str, Any] = field(default_factory=dict)


@register
@dataclass
class FailedMsg:
    """A child could not start or crashed; ``error`` is its message and traceback."""

    name: str
    error: str


@register
@dataclass
class ProgressMsg:
    """A child reached a startup milestone (e.g. the model path is resolved)."""

    name: str
    info: dict[str, Any] = field(default_factory=dict)


@register
@dataclass
class ConfigMsg:
    """Launcher -> tokenizer/detokenizer: what only the scheduler can find out.

    Sent as soon as the model path is known (limits still None, so tokenizers load while the
    weights do), and again with the limits once the scheduler is ready.
    """

    model_path: str
    max_seq_len: int | None = None
    vocab_size: int | None = None
