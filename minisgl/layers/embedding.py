"""Token embedding and LM head, both split over ranks along the vocabulary.

Rank ``r`` holds rows ``[r * n, (r + 1) * n)`` with ``n = ceil(vocab / tp)``; rows past the
real vocabulary are zero padding (their logits are sliced off by the engine).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import TPGroup
from minisgl.kernels import CpuKernels
from minisgl.kernels.cpu import PackedWeight
from minisgl.layers.linear import pack_panels


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp: TPGroup,
        weight: nn.Parameter | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.rows_per_rank = -(-num_embeddings // tp.size)
        self.start = tp.rank * self.rows_per_rank
        if weight is None:
            weight = nn.Parameter(
                torch.empty(self.rows_per_rank, embedding_dim), requires_grad=False
            )
            weight.weight_loader = self.weight_loader
        self.weight = weight

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[1] != param.shape[1] or loaded.shape[0] != self.num_embeddings:
            raise ValueError(
                f"embedding: checkpoint shape {tuple(loaded.shape)} != "
                f"({self.num_embeddings}, {param.shape[1]})"
            )
        n = max(0, min(self.rows_per_rank, self.num_embeddings - self.start))
        param.data[:n].copy_(loaded[self.start : self.start + n])
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mask = (local >= 0) & (local < self.rows_per_rank)
        out = F.embedding(local.masked_fill(~mask, 0), self.weight)
        out.mul_(mask.unsqueeze(-1).to(out.dtype))
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits over the (padded) vocabulary, gathered from all ranks.

    With ``tied`` the weight is the embedding's parameter itself (no copy); ``pack_for_cpu``
    then adds a panel-packed copy for the matmul.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp: TPGroup,
        tied: VocabParallelEmbedding | None = None,
    ) -> None:
        super().__init__(
            num_embeddings, embedding_dim, tp, weight=tied.weight if tied is not None else None
        )
        self.tied = tied is not None
        self.panels: PackedWeight | None = None
        self.kernels: CpuKernels | None = None

    def pack_for_cpu(self, weight_dtype: torch.dtype) -> None:
        """Switch the matmul to a panel-packed copy of the weight (compiled CPU kernels);
        a tied weight stays as it is for the embedding's lookups."""
        self.panels, self.kernels = pack_panels(self.weight, weight_dtype)
        if self.panels is not None and not self.tied:
            self.weight.data = self.weight.data.new_empty(0)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            assert self.kernels is not None
            return self.tp.all_gather(self.kernels.linear(hidden, self.panels, None), dim=-1)
        return self.tp.all_gather(F.linear(hidden, self.weight), dim=-1)
