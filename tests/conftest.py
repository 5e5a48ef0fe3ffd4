"""Fixtures shared by every test directory."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer."""
    from minisgl.models.loader import resolve_model_path
    from minisgl.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_path(None))
