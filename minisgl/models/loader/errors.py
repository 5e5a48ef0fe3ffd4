"""The one exception type raised by the model loader."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model could not be located, fetched, converted or read; the message names the problem."""
