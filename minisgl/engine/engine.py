"""``Engine``: builds model, KV pool, attention backend and sampler; runs one batch per call.

Per batch, every tensor the forward needs (input ids, positions, out_loc, attention
metadata, the rows that need logits) is built once in ``_prepare``; the model then runs
under ``torch.inference_mode`` and the LM head is applied only to those rows.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from minisgl.attention import (
    AttentionConfig,
    AttentionMetadata,
    create_backend,
    resolve_backend_name,
)
from minisgl.distributed import init_tp_group
from minisgl.engine.batch import Batch, BatchOutput, SampleInfo
from minisgl.engine.config import EngineConfig
from minisgl.engine.context import ForwardContext, forward_context
from minisgl.engine.sampler import Sampler
from minisgl.kernels import cpu_kernels
from minisgl.kvcache.mha_pool import MHAKVCache
from minisgl.models.base import CausalLM
from minisgl.models.config import ModelConfig
from minisgl.models.loader import iter_safetensors, load_generation_eos, resolve_model_path
from minisgl.models.registry import get_model_class

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_MEMORY_GB = 4.0
CPU_PACKED_LINEARS = True
"""On CPU, run linear layers on pre-packed weights: the compiled panel kernel where it exists,
else oneDNN (see scripts/bench_engine.py --pack)."""
MAX_POOL_SEQS = 64
"""The pool never holds more than this many ``max_seq_len`` sequences' worth of tokens."""


@dataclass
class _Prepared:
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_loc: torch.Tensor
    metadata: AttentionMetadata


class Engine:
    """One tensor-parallel rank of the model, its KV pool and its sampler."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = _resolve_device(config.device, config.tp_rank, config.tp_size)
        if self.device.type == "cpu":
            torch.set_num_threads(len(os.sched_getaffinity(0)))
        else:
            torch.cuda.set_device(self.device)
        self.dtype = _resolve_dtype(config.dtype, self.device)
        self.weight_dtype = _resolve_weight_dtype(config, self.dtype, self.device)
        self.kv_dtype = self.dtype if config.kv_dtype == "auto" else _DTYPES[config.kv_dtype]
        self.model_path: pathlib.Path = resolve_model_path(config.model)
        self.model_config: ModelConfig = ModelConfig.from_path(self.model_path)
        self.max_seq_len = self._max_seq_len()
        self.tp = init_tp_group(
            config.tp_rank, config.tp_size, self.device, config.dist_init_method
        )
        self.model = self._load_model()
        self.page_size = config.page_size
        self.num_pages = self._num_pages()
        self.attn_name = resolve_backend_name(config.attn, self.device)
        if self.kv_dtype != self.dtype and (self.device.type != "cpu" or self.attn_name != "torch"):
            raise ValueError(
                f"kv_dtype {config.kv_dtype} differs from the model dtype; that needs the torch "
                "attention backend on CPU"
            )
        self.kv_cache = MHAKVCache(
            num_layers=self.model_config.num_layers,
            num_pages=self.num_pages,
            page_size=self.page_size,
            num_kv_heads=self.num_local_kv_heads,
            head_dim=self.model_config.head_dim,
            dtype=self.kv_dtype,
            device=self.device,
            layout="interleaved" if self.attn_name == "torch" else "separate",
        )
        mc = self.model_config
        self.attn_config = AttentionConfig(
            num_heads=mc.num_heads // self.tp.size,
            num_kv_heads=self.num_local_kv_heads,
            head_dim=mc.head_dim,
            page_size=self.page_size,
            device=self.device,
            dtype=self.dtype,
            scale=mc.head_dim**-0.5,
            kv_dtype=self.kv_dtype,
        )
        self.attn_backend = create_backend(self.attn_name, self.attn_config, self.kv_cache)
        self.sampler = Sampler(mc.vocab_size, self.device)
        self.eos_token_ids: frozenset[int] = frozenset(mc.eos_token_ids) | load_generation_eos(
            self.model_path
        )

    @property
    def num_local_kv_heads(self) -> int:
        return max(1, self.model_config.num_kv_heads // self.tp.size)

    def _max_seq_len(self) -> int:
        mc = self.model_config
        limit = self.config.max_seq_len or mc.max_position_embeddings
        if mc.sliding_window is not None and mc.sliding_window < limit:
            logger.warning(
                "sliding-window attention is not implemented; capping max_seq_len to the "
                "window (%d tokens)",
                mc.sliding_window,
            )
            limit = mc.sliding_window
        return limit

    def _load_model(self) -> CausalLM:
        model_cls = get_model_class(self.model_config.architecture)
        with torch.device(self.device), _default_dtype(self.dtype):
            model = model_cls(self.model_config, self.tp, self.max_seq_len)
        model.load_weights(iter_safetensors(self.model_path))
        if (
            CPU_PACKED_LINEARS
            and self.device.type == "cpu"
            and self.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()
        ):
            model.pack_linears_for_cpu(self.weight_dtype)
        return model.eval()

    def _num_pages(self) -> int:
        if self.config.num_pages is not None:
            return self.config.num_pages
        mc = self.model_config
        token_bytes = MHAKVCache.token_bytes(
            mc.num_layers, self.num_local_kv_heads, mc.head_dim, self.kv_dtype
        )
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * self.config.memory_ratio
        else:
            budget = (self.config.kv_memory_gb or CPU_KV_MEMORY_GB) * (1 << 30)
        tokens = min(int(budget // token_bytes), MAX_POOL_SEQS * self.max_seq_len)
        num_pages = tokens // self.page_size
        if num_pages < 1:
            raise ValueError("the KV-cache memory budget does not fit a single page")
        return num_pages

    def forward(self, batch: Batch) -> BatchOutput:
        """Run ``batch`` and sample one token for each request with ``sample[i]`` set."""
        rows = [i for i, info in enumerate(batch.sample) if info is not None]
        infos: list[SampleInfo] = [batch.sample[i] for i in rows]
        logits = self._run(batch, rows)
        if not rows:
            return BatchOutput(next_token_ids=[])
        return self.sampler.sample(logits, infos)

    def forward_logits(self, batch: Batch, all_positions: bool = False) -> torch.Tensor:
        """float32 logits of each request's last position (``[batch.size, vocab]``), or of
        every computed position when ``all_positions`` (``[total extend tokens, vocab]``)."""
        logits = self._run(batch, None if all_positions else list(range(batch.size)))
        return logits[:, : self.model_config.vocab_size].float()

    @torch.inference_mode()
    def _run(self, batch: Batch, rows: list[int] | None) -> torch.Tensor:
        prepared = self._prepare(batch)
        ctx = ForwardContext(self.attn_backend, self.kv_cache, prepared.metadata, prepared.out_loc)
        with forward_context(ctx):
            hidden = self.model(prepared.input_ids, prepared.positions)
        if rows is not None and not (batch.is_decode and len(rows) == batch.size):
            ends = _cumsum(batch.extend_lens)
            idx = torch.tensor([ends[i] - 1 for i in rows], dtype=torch.int64)
            hidden = hidden.index_select(0, idx.to(self.device))
        return self.model.compute_logits(hidden).float()

    def _prepare(self, batch: Batch) -> _Prepared:
        ext = batch.extend_lens
        total = sum(ext)
        if len(batch.input_ids) != total or batch.out_loc.shape[0] != total:
            raise ValueError(
                f"batch has {len(batch.input_ids)} input ids and {batch.out_loc.shape[0]} out_loc "
                f"slots for {total} extend tokens"
            )
        if max(batch.device_len) > self.max_seq_len:
            raise ValueError(f"sequence longer than max_seq_len ({self.max_seq_len})")
        if batch.is_decode:
            positions = torch.tensor(batch.cached_len, dtype=torch.int64)
        else:
            positions = torch.cat(
                [
                    torch.arange(c, d)
                    for c, d in zip(batch.cached_len, batch.device_len, strict=True)
                ]
            )
        device = self.device
        return _Prepared(
            input_ids=torch.tensor(batch.input_ids, dtype=torch.int64).to(
                device, non_blocking=True
            ),
            positions=positions.to(device, non_blocking=True),
            out_loc=batch.out_loc.to(device, torch.int64, non_blocking=True),
            metadata=self.attn_backend.prepare(batch),
        )


def _cumsum(values: list[int]) -> list[int]:
    out, acc = [], 0
    for v in values:
        acc += v
        out.append(acc)
    return out


def _resolve_device(name: str, tp_rank: int, tp_size: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but CUDA is not available")
    if device.index is None:
        device = torch.device("cuda", tp_rank if tp_size > 1 else torch.cuda.current_device())
    return device


def _resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _resolve_weight_dtype(
    config: EngineConfig, dtype: torch.dtype, device: torch.device
) -> torch.dtype:
    """How CPU linear weights are stored. ``dtype=auto`` on CPU computes in float32 and
    stores weights as bfloat16 when the compiled matmul can read them: half the bytes per
    decode step, which is bound by memory bandwidth (scripts/bench_engine.py)."""
    if dtype != torch.float32 or device.type != "cpu" or not CPU_PACKED_LINEARS:
        return dtype
    explicit_fp32 = config.weight_dtype == "auto" and config.dtype != "auto"
    if config.weight_dtype == "float32" or explicit_fp32:
        return dtype
    kernels = cpu_kernels()
    if kernels is None or not kernels.native_gemm:
        if config.weight_dtype == "bfloat16":
            logger.warning("bfloat16 weights need the compiled AVX-512 CPU kernels; using float32")
        return dtype
    return torch.bfloat16


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
