"""``MHAKVCache``: the physical K/V pool.

Per layer, K and V are tensors ``[num_pages * page_size, num_kv_heads, head_dim]``; token
slot ``s`` lives at row ``s`` and page ``p`` covers slots ``[p * page_size, (p + 1) * page_size)``.
The pool starts all zero. One extra page after the last (``pad_page``, slots from
``pad_slot``) is never written: attention backends point padding indices at it, so masked
positions always read finite values::

    rows:  [ page 0 | page 1 | ... | page num_pages-1 | pad page (zeros) ]

Layouts (per layer): ``separate`` keeps K and V each contiguous (what paged GPU kernels
expect); ``interleaved`` stores a slot's K row next to its V row (``[slots, 2, heads, dim]``)
so one gather fetches both (what the torch backend prefers). ``k_cache`` / ``v_cache`` are
``[num_slots, heads, dim]`` views either way.
"""

from __future__ import annotations

import numpy as np
import torch

LAYOUTS = ("separate", "interleaved")


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """All-zero tensor; on CPU backed by calloc, so untouched pages cost no memory."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class MHAKVCache:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        layout: str = "separate",
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown KV layout {layout!r}; choose one of {LAYOUTS}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.layout = layout
        self.pad_page = num_pages
        self.pad_slot = self.num_slots
        rows = self.num_slots + page_size
        if layout == "separate":
            buffer = _zeros((2, num_layers, rows, num_kv_heads, head_dim), dtype, self.device)
            self._k = list(buffer[0].unbind(0))
            self._v = list(buffer[1].unbind(0))
            self._kv = None
        else:
            buffer = _zeros((num_layers, rows, 2, num_kv_heads, head_dim), dtype, self.device)
            self._kv = list(buffer.unbind(0))
            self._k = [kv[:, 0] for kv in self._kv]
            self._v = [kv[:, 1] for kv in self._kv]

    @staticmethod
    def token_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of K and V over all layers for one token slot."""
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def k_cache(self, layer: int) -> torch.Tensor:
        """``[num_slots, num_kv_heads, head_dim]`` keys of ``layer``."""
        return self._k[layer][: self.num_slots]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self._v[layer][: self.num_slots]

    def k_buffer(self, layer: int) -> torch.Tensor:
        """Keys of ``layer`` including the zero pad page (for padded gathers)."""
        return self._k[layer]

    def v_buffer(self, layer: int) -> torch.Tensor:
        return self._v[layer]

    def kv_buffer(self, layer: int) -> torch.Tensor:
        """Interleaved layout only: ``[num_slots + page_size, 2, heads, dim]``, pad page
        included (K then V per slot)."""
        if self._kv is None:
            raise ValueError("kv_buffer needs the interleaved layout")
        return self._kv[layer]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor) -> None:
        """Write ``k``, ``v`` (``[T, num_kv_heads, head_dim]``) at slots ``out_loc`` (``[T]``),
        converted to the pool's dtype."""
        if self._kv is not None:
            self._kv[layer].index_copy_(0, out_loc, torch.stack((k, v), dim=1).to(self.dtype))
        else:
            self._k[layer].index_copy_(0, out_loc, k.to(self.dtype))
            self._v[layer].index_copy_(0, out_loc, v.to(self.dtype))
