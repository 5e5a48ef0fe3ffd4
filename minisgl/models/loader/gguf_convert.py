"""Converting a llama.cpp GGUF file into a float32 Hugging Face directory.

Tensors are dequantized with ``gguf.quants.dequantize`` and renamed to HF parameter names;
the Q/K row permutation llama.cpp applies to llama-architecture models is undone. config.json
and generation_config.json are built from the GGUF metadata; the tokenizer is converted by
``transformers`` and saved with the GGUF chat template.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from minisgl.models.loader.cache import build_once, cache_root
from minisgl.models.loader.errors import ModelLoadError

SHARD_BYTES = 2 * 1024**3


@dataclass(frozen=True)
class GGUFArch:
    """How one GGUF ``general.architecture`` maps onto a transformers model class."""

    hf_architecture: str
    model_type: str
    permuted_qk: bool


ARCHITECTURES: dict[str, GGUFArch] = {
    "llama": GGUFArch("LlamaForCausalLM", "llama", permuted_qk=True),
    "qwen2": GGUFArch("Qwen2ForCausalLM", "qwen2", permuted_qk=False),
    "qwen3": GGUFArch("Qwen3ForCausalLM", "qwen3", permuted_qk=False),
}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_IGNORED = {"rope_freqs.weight"}
_LOAD_TIME_KEYS = ("is_local", "local_files_only", "gguf_file", "name_or_path")
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_TENSOR = re.compile(r"^(\w+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF parameter name of a llama.cpp tensor name; None for tensors that are dropped.

    Raises ModelLoadError for names with no known mapping.
    """
    if gguf_name in _IGNORED:
        return None
    m = _LAYER_TENSOR.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    m = _GLOBAL_TENSOR.match(gguf_name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no known Hugging Face name")


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of Q/K projection rows (weights or biases).

    Within each head llama.cpp stores rows ``[r0, r(d/2), r1, r(d/2+1), ...]`` (the pairs its
    rotary kernel rotates together); HF keeps the halves apart: ``[r0 .. r(d/2-1), r(d/2) ..]``.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ModelLoadError(f"cannot unpermute {rows} rows over {num_heads} heads")
    half = rows // num_heads // 2
    split = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


class GGUFFile:
    """A GGUF file's metadata and tensors (memory-mapped by gguf.GGUFReader)."""

    def __init__(self, path: pathlib.Path):
        import gguf

        self.path = pathlib.Path(path)
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as e:
            raise ModelLoadError(f"cannot read GGUF file {self.path}: {e}") from e
        self.metadata: dict[str, Any] = {}
        for key, field in self.reader.fields.items():
            if key.startswith("tokenizer.ggml.") and key.rsplit(".", 1)[1] in (
                "tokens",
                "scores",
                "token_type",
                "merges",
            ):
                continue
            try:
                self.metadata[key] = field.contents()
            except Exception:
                continue
        self.arch_name = str(self.metadata.get("general.architecture", ""))
        if self.arch_name not in ARCHITECTURES:
            supported = ", ".join(sorted(ARCHITECTURES))
            raise ModelLoadError(
                f"GGUF architecture {self.arch_name!r} in {self.path} is not supported "
                f"(supported: {supported})"
            )
        self.arch = ARCHITECTURES[self.arch_name]

    def arch_value(self, key: str, default: Any = None) -> Any:
        """Metadata ``<architecture>.<key>``."""
        return self.metadata.get(f"{self.arch_name}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.arch_value(key)
        if value is None:
            raise ModelLoadError(f"GGUF file {self.path} lacks metadata {self.arch_name}.{key}")
        return value

    def tensor_names(self) -> list[str]:
        return [t.name for t in self.reader.tensors]

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        for t in self.reader.tensors:
            if t.name == name:
                return tuple(int(d) for d in reversed(t.shape))
        raise ModelLoadError(f"GGUF file {self.path} has no tensor {name!r}")

    def hf_config(self) -> dict[str, Any]:
        """A config.json dict for the matching transformers class."""
        hidden = int(self.require("embedding_length"))
        num_heads = int(self.require("attention.head_count"))
        num_kv_heads = _uniform(self.arch_value("attention.head_count_kv", num_heads), "kv heads")
        head_dim = int(self.arch_value("attention.key_length", hidden // num_heads))
        names = set(self.tensor_names())
        vocab_size = self.tensor_shape("token_embd.weight")[0]
        bos = self.metadata.get("tokenizer.ggml.bos_token_id")
        eos = self.metadata.get("tokenizer.ggml.eos_token_id")
        config: dict[str, Any] = {
            "architectures": [self.arch.hf_architecture],
            "model_type": self.arch.model_type,
            "hidden_size": hidden,
            "intermediate_size": _uniform(self.require("feed_forward_length"), "ffn size"),
            "num_hidden_layers": int(self.require("block_count")),
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": _float32_repr(
                self.arch_value("attention.layer_norm_rms_epsilon", 1e-6)
            ),
            "rope_theta": _float32_repr(self.arch_value("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self.arch_value("context_length", 2048)),
            "vocab_size": vocab_size,
            "tie_word_embeddings": "output.weight" not in names,
            "torch_dtype": "float32",
        }
        if self.arch.model_type == "llama":
            config["attention_bias"] = "blk.0.attn_q.bias" in names
            config["mlp_bias"] = False
        rope_scaling = self._rope_scaling()
        if rope_scaling:
            config["rope_scaling"] = rope_scaling
        if bos is not None:
            config["bos_token_id"] = int(bos)
        if eos is not None:
            config["eos_token_id"] = int(eos)
        pad = self.metadata.get("tokenizer.ggml.padding_token_id")
        if pad is not None:
            config["pad_token_id"] = int(pad)
        return config

    def _rope_scaling(self) -> dict[str, Any] | None:
        kind = self.arch_value("rope.scaling.type")
        factor = self.arch_value("rope.scaling.factor")
        if kind in (None, "none") or not factor:
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(factor)}
        if kind == "yarn":
            original = self.arch_value("rope.scaling.original_context_length")
            scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
            if original:
                scaling["original_max_position_embeddings"] = int(original)
            return scaling
        raise ModelLoadError(f"GGUF file {self.path} uses unsupported rope scaling {kind!r}")

    def generation_config(self) -> dict[str, Any]:
        """generation_config.json: bos and every end-of-turn id the GGUF declares."""
        eos_ids: list[int] = []
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            value = self.metadata.get(f"tokenizer.ggml.{key}")
            if value is not None and int(value) not in eos_ids:
                eos_ids.append(int(value))
        config: dict[str, Any] = {}
        bos = self.metadata.get("tokenizer.ggml.bos_token_id")
        if bos is not None:
            config["bos_token_id"] = int(bos)
        if eos_ids:
            config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
        pad = self.metadata.get("tokenizer.ggml.padding_token_id")
        if pad is not None:
            config["pad_token_id"] = int(pad)
        return config

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 tensor) for every weight, dequantized one at a time."""
        from gguf.quants import dequantize

        num_heads = int(self.require("attention.head_count"))
        num_kv_heads = _uniform(self.arch_value("attention.head_count_kv", num_heads), "kv heads")
        for t in self.reader.tensors:
            name = hf_tensor_name(t.name)
            if name is None:
                continue
            shape = tuple(int(d) for d in reversed(t.shape))
            try:
                array = dequantize(t.data, t.tensor_type)
            except Exception as e:
                raise ModelLoadError(
                    f"cannot dequantize GGUF tensor {t.name} ({t.tensor_type.name}) "
                    f"in {self.path}: {e}"
                ) from e
            array = np.asarray(array, dtype=np.float32).reshape(shape)
            if not array.flags.writeable:
                array = array.copy()
            if self.arch.permuted_qk and ".self_attn.q_proj." in name:
                array = unpermute_rope_rows(array, num_heads)
            elif self.arch.permuted_qk and ".self_attn.k_proj." in name:
                array = unpermute_rope_rows(array, num_kv_heads)
            yield name, torch.from_numpy(np.ascontiguousarray(array))


def _float32_repr(value: Any) -> float:
    """GGUF stores floats as float32; keep the shortest decimal that round-trips (1e-05)."""
    return float(str(np.float32(value)))


def _uniform(value: Any, what: str) -> int:
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ModelLoadError(f"GGUF models with per-layer {what} are not supported")
        value = value[0]
    return int(value)


def convert_gguf(gguf_path: pathlib.Path, out_dir: pathlib.Path) -> None:
    """Write an HF directory for ``gguf_path`` into the existing, empty ``out_dir``.

    Produces config.json, generation_config.json, tokenizer files (with the chat template)
    and float32 safetensors (model.safetensors, or shards plus an index for large models).
    """
    gguf_file = GGUFFile(gguf_path)
    out_dir = pathlib.Path(out_dir)
    _write_json(out_dir / "config.json", gguf_file.hf_config())
    _write_json(out_dir / "generation_config.json", gguf_file.generation_config())
    _write_weights(gguf_file, out_dir)
    _write_tokenizer(gguf_file, out_dir)


def _write_json(path: pathlib.Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_weights(gguf_file: GGUFFile, out_dir: pathlib.Path) -> None:
    from safetensors.torch import save_file

    parts: list[tuple[pathlib.Path, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0
    total_bytes = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        part = out_dir / f"part-{len(parts):05d}.safetensors"
        save_file(shard, str(part), metadata={"format": "pt"})
        parts.append((part, list(shard)))
        shard, shard_bytes = {}, 0

    for name, tensor in gguf_file.hf_tensors():
        size = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + size > SHARD_BYTES:
            flush()
        shard[name] = tensor
        shard_bytes += size
        total_bytes += size
    if shard or not parts:
        flush()
    if len(parts) == 1:
        os.replace(parts[0][0], out_dir / "model.safetensors")
        return
    weight_map: dict[str, str] = {}
    for i, (part, names) in enumerate(parts):
        final = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        os.replace(part, out_dir / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    _write_json(out_dir / "model.safetensors.index.json", index)


def _write_tokenizer(gguf_file: GGUFFile, out_dir: pathlib.Path) -> None:
    from transformers import AutoTokenizer

    path = gguf_file.path
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise ModelLoadError(f"cannot convert the tokenizer of GGUF file {path}: {e}") from e
    template = gguf_file.metadata.get("tokenizer.chat_template")
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = str(template)
    context = gguf_file.arch_value("context_length")
    if context:
        tokenizer.model_max_length = int(context)
    tokenizer.save_pretrained(str(out_dir))
    config_file = out_dir / "tokenizer_config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        for key in _LOAD_TIME_KEYS:
            config.pop(key, None)
        _write_json(config_file, config)


def gguf_cache_dir(gguf_path: pathlib.Path) -> pathlib.Path:
    """The cache entry for a GGUF file, keyed by its resolved path, size and mtime."""
    resolved = pathlib.Path(gguf_path).resolve()
    stat = resolved.stat()
    key = hashlib.sha256(f"{resolved}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    return cache_root() / "gguf" / f"{resolved.stem}-{key[:16]}"


def gguf_to_cached_dir(gguf_path: pathlib.Path) -> pathlib.Path:
    """Convert ``gguf_path`` once into the cache and return the HF directory."""
    gguf_path = pathlib.Path(gguf_path).resolve()
    stat = gguf_path.stat()
    source = {"gguf": str(gguf_path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return build_once(gguf_cache_dir(gguf_path), lambda tmp: convert_gguf(gguf_path, tmp), source)
