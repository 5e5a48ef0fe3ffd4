"""The tensor-parallel group: which rank this process is, and the collectives between ranks.

A ``TPGroup`` is passed explicitly to every layer that shards or communicates; with
``size == 1`` every collective is a no-op, so single-process code never touches
``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """Rank and size of this process in its tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    """The process group to communicate over; None means the default (world) group."""

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"invalid tensor-parallel rank {self.rank} of size {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over all ranks, in place; returns ``x``."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim``, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``x`` on every rank with rank ``src``'s value; returns ``x``."""
        if self.size > 1:
            dist.broadcast(x, src=src, group=self.group)
        return x

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)


def init_tp_group(
    rank: int, size: int, device: torch.device, init_method: str | None = None
) -> TPGroup:
    """Join (or create) the default process group for tensor parallelism.

    Uses NCCL on CUDA and gloo otherwise. ``init_method`` defaults to ``env://``
    (``MASTER_ADDR`` / ``MASTER_PORT``). If ``torch.distributed`` is already initialized
    with a matching world, it is reused as is.
    """
    if size == 1:
        return TPGroup(0, 1)
    if dist.is_initialized():
        if dist.get_world_size() != size or dist.get_rank() != rank:
            raise ValueError(
                f"torch.distributed is initialized as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but tensor parallelism asks for rank {rank} of {size}"
            )
        return TPGroup(rank, size)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend, init_method=init_method or "env://", rank=rank, world_size=size
    )
    return TPGroup(rank, size)
