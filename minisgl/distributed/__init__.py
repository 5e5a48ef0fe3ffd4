"""Tensor-parallel process group and its collectives."""

from __future__ import annotations

from minisgl.distributed.group import TPGroup, init_tp_group

__all__ = ["TPGroup", "init_tp_group"]
