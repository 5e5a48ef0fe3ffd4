"""msgpack (de)serialization of message dataclasses.

A registered dataclass travels as a msgpack extension value holding ``[class name, field
values in declaration order]``. Only registered classes are rebuilt on the way in, so nothing
arbitrary is constructed from the wire, user data (plain maps, strings) can never be mistaken
for a message, and pickle is never used. Tuples arrive as lists.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import msgpack

EXT_CODE = 7
T = TypeVar("T")

_classes: dict[str, type] = {}
_fields: dict[type, tuple[str, ...]] = {}


def register(cls: type[T]) -> type[T]:
    """Class decorator: allow the dataclass ``cls`` on the wire."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a dataclass")
    name = cls.__name__
    if _classes.get(name, cls) is not cls:
        raise ValueError(f"a different message class named {name} is already registered")
    _classes[name] = cls
    _fields[cls] = tuple(f.name for f in dataclasses.fields(cls) if f.init)
    return cls


def _default(obj: Any) -> Any:
    names = _fields.get(type(obj))
    if names is None:
        raise TypeError(f"cannot serialize {type(obj).__name__}: not a registered message")
    payload = [type(obj).__name__, [getattr(obj, n) for n in names]]
    return msgpack.ExtType(EXT_CODE, msgpack.packb(payload, default=_default, use_bin_type=True))


def _ext_hook(code: int, data: bytes) -> Any:
    if code != EXT_CODE:
        raise ValueError(f"unknown msgpack extension type {code}")
    name, values = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False)
    cls = _classes.get(name)
    if cls is None:
        raise ValueError(f"unknown message type {name!r}")
    names = _fields[cls]
    if len(values) != len(names):
        raise ValueError(f"{name} expects {len(names)} fields, got {len(values)}")
    return cls(**dict(zip(names, values, strict=True)))


def encode(msg: Any) -> bytes:
    """Serialize a registered dataclass (which may nest others, lists, maps and scalars)."""
    return msgpack.packb(msg, default=_default, use_bin_type=True)


def decode(data: bytes) -> Any:
    """Inverse of :func:`encode`; raises ``ValueError`` on unknown or malformed data."""
    try:
        return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"malformed message: {exc}") from exc
