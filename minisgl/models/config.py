"""``ModelConfig``: the HF ``config.json`` converted once into the fields our models read."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from minisgl.models.loader.errors import ModelLoadError

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; ``rope_type`` is one of ``ROPE_TYPES``."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a decoder-only transformer.

    Per-architecture differences are flags: ``qkv_bias`` (bias on q/k/v projections),
    ``o_bias``, ``mlp_bias``, ``qk_norm`` (per-head RMSNorm on q and k before rotary).
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

    @classmethod
    def from_path(cls, path: pathlib.Path) -> ModelConfig:
        """Read ``config.json`` of an HF model directory."""
        file = pathlib.Path(path) / "config.json"
        try:
            data = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read model config {file}: {e}") from e
        return cls.from_hf(data)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | Any) -> ModelConfig:
        """Convert an HF config (a ``config.json`` dict or a ``PretrainedConfig``)."""
        from minisgl.models.registry import resolve_architecture

        d: Mapping[str, Any] = hf if isinstance(hf, Mapping) else hf.to_dict()
        if isinstance(d.get("text_config"), Mapping) and "hidden_size" not in d:
            d = {**d["text_config"], "architectures": d.get("architectures")}
        model_type = str(d.get("model_type", ""))
        arch = resolve_architecture(d.get("architectures"), model_type)
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"unsupported activation {act!r} (only 'silu' is supported)")
        try:
            hidden = int(d["hidden_size"])
            num_heads = int(d["num_attention_heads"])
            head_dim = int(d.get("head_dim") or hidden // num_heads)
            sliding = d.get("sliding_window")
            if model_type in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
                sliding = None
            return cls(
                architecture=arch,
                model_type=model_type,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
                head_dim=head_dim,
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope=_rope_config(d, head_dim),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                qkv_bias=model_type == "qwen2" or bool(d.get("attention_bias", False)),
                o_bias=bool(d.get("attention_bias", False)) and model_type != "qwen2",
                mlp_bias=bool(d.get("mlp_bias", False)),
                qk_norm=model_type == "qwen3",
                sliding_window=int(sliding) if sliding else None,
                eos_token_ids=_int_tuple(d.get("eos_token_id")),
                torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"model config is missing or has a bad field: {e!r}") from e


def _int_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_config(d: Mapping[str, Any], head_dim: int) -> RopeConfig:
    params = dict(d.get("rope_parameters") or {})
    legacy = d.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    partial = float(params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ModelLoadError(f"partial rotary embeddings are not supported (factor {partial})")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", d.get("max_position_embeddings", 8192))
        ),
    )
