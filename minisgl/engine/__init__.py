"""The engine: model + KV pool + attention backend + sampler, one forward per batch.

Names are imported lazily so that ``minisgl.engine.batch`` stays cheap to import.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "Engine": "minisgl.engine.engine",
    "EngineConfig": "minisgl.engine.config",
    "Batch": "minisgl.engine.batch",
    "BatchOutput": "minisgl.engine.batch",
    "SampleInfo": "minisgl.engine.batch",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
