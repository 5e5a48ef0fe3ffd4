"""The decoder shared by all supported architectures, and its checkpoint loading.

Module names mirror HF checkpoints (``model.layers.{i}.self_attn...``) except that
q/k/v and gate/up are merged; ``CausalLM.load_weights`` maps the HF names onto the
merged parameters and each layer's ``weight_loader`` copies this rank's shard.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from minisgl.distributed import TPGroup
from minisgl.layers import (
    AttentionLayer,
    LinearBase,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryBatch,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
)
from minisgl.models.config import ModelConfig
from minisgl.models.loader.errors import ModelLoadError

logger = logging.getLogger(__name__)

_MERGED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _copy_whole(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint shape {tuple(loaded.shape)} != {tuple(param.shape)}")
    param.data.copy_(loaded)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias, tp
        )
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, tp
        )
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.head_dim = cfg.head_dim
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.attn = AttentionLayer(layer_id, self.num_heads, self.num_kv_heads, cfg.head_dim)

    def forward(self, x: torch.Tensor, rope: RotaryBatch) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        t, h, hk, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qk_norm:
            q = rope.apply(self.q_norm(qkv[:, : h * d].reshape(t, h, d)))
            k = rope.apply(self.k_norm(qkv[:, h * d : (h + hk) * d].reshape(t, hk, d)))
        else:
            qk = rope.apply(qkv[:, : (h + hk) * d].view(t, h + hk, d))
            q, k = qk[:, :h], qk[:, h:]
        v = qkv[:, (h + hk) * d :].view(t, hk, d)
        return self.o_proj(self.attn(q, k, v))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, cfg.mlp_bias, tp
        )
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, tp)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RotaryBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.forward_residual(hidden, residual)
        hidden = self.self_attn(hidden, rope)
        hidden, residual = self.post_attention_layernorm.forward_residual(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rope = self.rotary.lookup(positions)
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope)
        return self.norm.forward_residual(hidden, residual)[0]


class CausalLM(nn.Module):
    """A decoder-only LM: ``forward`` gives final hidden states, ``compute_logits`` the
    (vocabulary-padded, gathered over ranks) logits of the rows it is given.

    Construct it under the target ``torch.device`` and default dtype: parameters are
    allocated uninitialized and filled once by ``load_weights``.
    """

    def __init__(self, config: ModelConfig, tp: TPGroup, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = DecoderModel(config, tp, max_positions)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, tied=tied)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def pack_linears_for_cpu(self, weight_dtype: torch.dtype) -> None:
        """Switch every linear layer and the LM head to pre-packed CPU weights (after
        loading); see ``LinearBase.pack_for_cpu``."""
        for module in self.modules():
            if isinstance(module, LinearBase):
                module.pack_for_cpu(weight_dtype)
        self.lm_head.pack_for_cpu(weight_dtype)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every parameter from ``(HF name, full tensor)`` pairs.

        Raises ModelLoadError if a parameter is never loaded or a shape does not match.
        """
        params = dict(self.named_parameters())
        expected: dict[str, set] = {name: {None} for name in params}
        for name in params:
            if ".qkv_proj." in name:
                expected[name] = {"q", "k", "v"}
            elif ".gate_up_proj." in name:
                expected[name] = {0, 1}
        loaded: dict[str, set] = {name: set() for name in params}
        for hf_name, tensor in weights:
            if hf_name.endswith(_IGNORED_SUFFIXES):
                continue
            if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            name, shard = hf_name, None
            for old, new, shard_id in _MERGED:
                if old in hf_name:
                    name, shard = hf_name.replace(old, new), shard_id
                    break
            param = params.get(name)
            if param is None:
                logger.warning("ignoring checkpoint tensor %s (no matching parameter)", hf_name)
                continue
            try:
                getattr(param, "weight_loader", _copy_whole)(param, tensor, shard)
            except (ValueError, RuntimeError) as e:
                raise ModelLoadError(f"cannot load checkpoint tensor {hf_name}: {e}") from e
            loaded[name].add(shard)
        missing = sorted(n for n in params if loaded[n] != expected[n])
        if missing:
            raise ModelLoadError(
                f"checkpoint is missing weights for {len(missing)} parameter(s): "
                f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
            )
