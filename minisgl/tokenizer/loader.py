"""Loading a model's tokenizer from its local directory."""

from __future__ import annotations

import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(model_path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """Load the tokenizer stored in a local Hugging Face style model directory.

    Never touches the network. Raises ``ValueError`` naming the directory when the
    tokenizer files are missing or unreadable.
    """
    path = os.fspath(model_path)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load a tokenizer from {path}: {exc}") from exc
