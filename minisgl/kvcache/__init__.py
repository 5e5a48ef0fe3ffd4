"""KV cache: the physical K/V pool (``MHAKVCache``) and the prefix caches.

``make_prefix_cache(name, page_size)`` builds a prefix cache by name ("radix" or "naive");
the implementations are imported only when selected.
"""

from __future__ import annotations

import importlib

from minisgl.kvcache.base import BasePrefixCache, InsertResult, PrefixMatch

_PREFIX_CACHES: dict[str, tuple[str, str]] = {
    "radix": ("minisgl.kvcache.radix", "RadixPrefixCache"),
    "naive": ("minisgl.kvcache.naive", "NaivePrefixCache"),
}

_LAZY: dict[str, tuple[str, str]] = {
    "RadixPrefixCache": _PREFIX_CACHES["radix"],
    "NaivePrefixCache": _PREFIX_CACHES["naive"],
    "MHAKVCache": ("minisgl.kvcache.mha_pool", "MHAKVCache"),
}

__all__ = [
    "BasePrefixCache",
    "InsertResult",
    "MHAKVCache",
    "NaivePrefixCache",
    "PrefixMatch",
    "RadixPrefixCache",
    "make_prefix_cache",
    "prefix_cache_names",
]


def prefix_cache_names() -> list[str]:
    """Names accepted by ``make_prefix_cache``."""
    return sorted(_PREFIX_CACHES)


def make_prefix_cache(name: str, page_size: int) -> BasePrefixCache:
    """Build the prefix cache registered as ``name`` for pages of ``page_size`` tokens."""
    if name not in _PREFIX_CACHES:
        raise ValueError(f"unknown prefix cache {name!r}; choose one of {prefix_cache_names()}")
    module, attr = _PREFIX_CACHES[name]
    return getattr(importlib.import_module(module), attr)(page_size)


def __getattr__(name: str) -> object:
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
