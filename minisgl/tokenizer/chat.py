"""Turning chat messages and plain prompts into token ids."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

ROLES = ("system", "user", "assistant", "tool", "developer")
ROLE_ALIASES = {"developer": "system"}


def validate_messages(messages: object) -> list[dict[str, Any]]:
    """Check OpenAI-style chat messages and return them normalized for a chat template.

    Each message needs a ``role`` (one of :data:`ROLES`; ``developer`` becomes ``system``)
    and a ``content`` that is a string or a list of ``{"type": "text", "text": str}`` parts
    (joined into one string). An assistant message carrying ``tool_calls`` may omit its
    content. Other keys are passed through to the template unchanged.

    Raises ``ValueError`` naming the offending field, e.g. ``messages[1].role``.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise ValueError("messages must be a list of message objects")
    if not messages:
        raise ValueError("messages must not be empty")
    return [_normalize(i, message) for i, message in enumerate(messages)]


def _normalize(index: int, message: object) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise ValueError(f"{where} must be an object with 'role' and 'content'")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        allowed = ", ".join(ROLES)
        raise ValueError(f"{where}.role must be one of {allowed} (got {role!r})")
    content = message.get("content")
    if content is None and role == "assistant" and message.get("tool_calls"):
        content = ""
    normalized = dict(message)
    normalized["role"] = ROLE_ALIASES.get(role, role)
    normalized["content"] = _content_text(f"{where}.content", content)
    return normalized


def _content_text(where: str, content: object) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence) or isinstance(content, bytes):
        raise ValueError(f"{where} must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        part_where = f"{where}[{j}]"
        if not isinstance(part, Mapping):
            raise ValueError(f"{part_where} must be an object like {{'type': 'text', 'text': ...}}")
        kind = part.get("type")
        if kind != "text":
            raise ValueError(
                f"{part_where}.type {kind!r} is not supported; only 'text' content parts are"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{part_where}.text must be a string")
        texts.append(text)
    return "".join(texts)


def render_chat(
    tok: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool = True
) -> str:
    """Validate ``messages`` and render them with the tokenizer's chat template, as text.

    Without a chat template, falls back to ChatML::

        <|im_start|>{role}\\n{content}<|im_end|>\\n   (one block per message)
        <|im_start|>assistant\\n                        (when add_generation_prompt)
    """
    messages = validate_messages(messages)
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        if not isinstance(text, str):
            raise TypeError(f"chat template rendered {type(text).__name__}, expected str")
        return text
    blocks = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        blocks.append("<|im_start|>assistant\n")
    return "".join(blocks)


def encode_chat(
    tok: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of ``messages`` rendered with the model's chat template.

    The rendered text already carries the template's special tokens (BOS included when the
    template writes it), so it is encoded without adding special tokens again.
    Raises ``ValueError`` with a clear message on invalid roles or content.
    """
    text = render_chat(tok, messages, add_generation_prompt)
    return list(tok.encode(text, add_special_tokens=False))


def encode_text(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of a plain completion prompt, with the tokenizer's default special tokens."""
    if not isinstance(text, str):
        raise ValueError("prompt must be a string")
    return list(tok.encode(text))
