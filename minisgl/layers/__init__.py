"""Building blocks shared by all models: TP-sharded linears, embeddings, norms, rotary,
activations and the ``AttentionLayer`` through which models reach the KV pool."""

from __future__ import annotations

from minisgl.layers.activation import SiluAndMul
from minisgl.layers.attention import AttentionLayer
from minisgl.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import RotaryBatch, RotaryEmbedding

__all__ = [
    "AttentionLayer",
    "LinearBase",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "RotaryBatch",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "VocabParallelEmbedding",
]
