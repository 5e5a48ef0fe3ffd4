"""``AttentionLayer``: the only way models reach the KV pool and the attention backend."""

from __future__ import annotations

import torch
from torch import nn

from minisgl.engine.context import get_forward_context


class AttentionLayer(nn.Module):
    """Stores this layer's new K/V at the batch's ``out_loc`` slots, then attends.

    ``q``: ``[T, local_heads, head_dim]``; ``k``, ``v``: ``[T, local_kv_heads, head_dim]``.
    Returns ``[T, local_heads * head_dim]``.
    """

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        ctx.kv_cache.store(self.layer_id, k, v, ctx.out_loc)
        out = ctx.backend.forward(q, self.layer_id, ctx.kv_cache, ctx.metadata)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
