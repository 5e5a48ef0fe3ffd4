"""``EngineConfig``: how to build an ``Engine`` (resolved once by ``Engine.__init__``)."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("auto", "float32", "bfloat16", "float16")
WEIGHT_DTYPES = ("auto", "float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class EngineConfig:
    """Model, device and KV-pool settings of one engine (one tensor-parallel rank).

    ``attn``: ``auto`` | ``torch`` | ``flashinfer`` | ``"PREFILL,DECODE"``.
    ``num_pages`` None sizes the pool from ``kv_memory_gb`` (CPU, default 4 GiB) or from
    ``memory_ratio`` of the free device memory after the weights (CUDA).
    ``dist_init_method``: torch.distributed rendezvous for ``tp_size > 1`` (default env://).
    ``weight_dtype``: how linear weights are stored on CPU when ``dtype`` resolves to float32
    and the compiled kernels exist (``bfloat16``: half the bytes read per decode step,
    float32 arithmetic); ignored elsewhere.
    ``kv_dtype``: the KV cache's dtype; ``auto`` is the model dtype. ``bfloat16`` under a
    float32 model (CPU, torch attention backend) halves KV memory and attention reads.
    """

    model: str | None = None
    dtype: str = "auto"
    weight_dtype: str = "auto"
    kv_dtype: str = "auto"
    device: str = "auto"
    page_size: int = 1
    num_pages: int | None = None
    kv_memory_gb: float | None = None
    memory_ratio: float = 0.85
    attn: str = "auto"
    tp_rank: int = 0
    tp_size: int = 1
    max_seq_len: int | None = None
    dist_init_method: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(
                f"weight_dtype must be one of {WEIGHT_DTYPES}, got {self.weight_dtype!r}"
            )
        if self.kv_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"kv_dtype must be one of {WEIGHT_DTYPES}, got {self.kv_dtype!r}")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if self.kv_memory_gb is not None and self.kv_memory_gb <= 0:
            raise ValueError(f"kv_memory_gb must be > 0, got {self.kv_memory_gb}")
        if not 0 < self.memory_ratio <= 1:
            raise ValueError(f"memory_ratio must be in (0, 1], got {self.memory_ratio}")
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"bad tensor-parallel rank {self.tp_rank} of size {self.tp_size}")
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {self.max_seq_len}")
