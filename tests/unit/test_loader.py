"""Model location and weight loading: local dirs, safetensors, GGUF conversion, default, hub."""

from __future__ import annotations

import json
import pathlib
import sys
import threading
import time

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from minisgl.models.loader import (
    DEFAULT_MODEL,
    ModelLoadError,
    default_model,
    gguf_convert,
    iter_safetensors,
    load_generation_eos,
    resolve_model_path,
)
from minisgl.models.loader import cache as cache_mod

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> pathlib.Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("MINISGL_CACHE", str(root))
    return root


def _save_dir(path: pathlib.Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return
    names = list(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(path / file))
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def _random_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(10, 4, generator=g),
        "model.norm.weight": torch.randn(4, generator=g),
        "lm_head.weight": torch.randn(10, 4, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(8, 4, generator=g).half(),
    }


# ---------------------------------------------------------------- local dirs and safetensors


@pytest.mark.parametrize("shards", [1, 3])
def test_local_dir_roundtrip(tmp_path, shards):
    tensors = _random_tensors()
    _save_dir(tmp_path / "m", tensors, shards)
    assert resolve_model_path(str(tmp_path / "m")) == tmp_path / "m"
    loaded = dict(iter_safetensors(tmp_path / "m"))
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype
        assert torch.equal(loaded[name], tensor)


def test_missing_paths_are_clear_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for text in [str(tmp_path / "nope"), "./nope", "~/surely-not-here-minisgl", "x.gguf", "a/b/c"]:
        with pytest.raises(ModelLoadError, match="does not exist"):
            resolve_model_path(text)


def test_dir_without_config(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model_path(str(tmp_path / "m"))


def test_non_gguf_file(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"abc")
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        resolve_model_path(str(tmp_path / "weights.bin"))


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_safetensors_names_the_file(tmp_path, damage):
    _save_dir(tmp_path / "m", _random_tensors(), shards=2)
    bad = tmp_path / "m" / "model-00002-of-00002.safetensors"
    data = bad.read_bytes()
    bad.write_bytes({"truncate": data[:-7], "garbage": b"\x07" * 100, "empty": b""}[damage])
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        list(iter_safetensors(tmp_path / "m"))


def test_missing_shard_names_the_file(tmp_path):
    _save_dir(tmp_path / "m", _random_tensors(), shards=2)
    (tmp_path / "m" / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00001-of-00002.safetensors"):
        list(iter_safetensors(tmp_path / "m"))


def test_no_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no safetensors"):
        list(iter_safetensors(tmp_path))


@pytest.mark.parametrize(
    ("config", "generation", "expected"),
    [
        ({"eos_token_id": 2}, None, {2}),
        ({"eos_token_id": [2, 7]}, {"eos_token_id": 9}, {2, 7, 9}),
        ({}, {"eos_token_id": [3, 4]}, {3, 4}),
        ({"text_config": {"eos_token_id": 5}}, {"eos_token_id": None}, {5}),
        ({}, None, set()),
    ],
)
def test_load_generation_eos(tmp_path, config, generation, expected):
    (tmp_path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    assert load_generation_eos(tmp_path) == frozenset(expected)


# ---------------------------------------------------------------- hub


def _hub_error(repo_id: str) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(ModelLoadError) as info:
        resolve_model_path(repo_id)
    return str(info.value), time.monotonic() - start


def test_hub_unavailable_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    message, seconds = _hub_error("minisgl-test/does-not-exist")
    assert "minisgl-test/does-not-exist" in message and "\n" not in message
    assert seconds < 20


def test_hub_unavailable_online_attempt(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    message, seconds = _hub_error("minisgl-test/does-not-exist-4b1c9")
    assert "minisgl-test/does-not-exist-4b1c9" in message and "\n" not in message
    assert seconds < 20


def test_hub_without_huggingface_hub(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    message, _ = _hub_error("org/model")
    assert "huggingface_hub is not installed" in message


# ---------------------------------------------------------------- cache atomicity


def test_failed_build_leaves_nothing(tmp_path):
    def build(out: pathlib.Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        cache_mod.build_once(tmp_path / "entry", build, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == [".entry.lock"]


def test_killed_build_leftovers_are_removed(tmp_path):
    (tmp_path / ".entry.tmp-killed").mkdir()
    (tmp_path / ".entry.tmp-killed" / "model.safetensors").write_bytes(b"partial")
    cache_mod.build_once(tmp_path / "entry", lambda out: (out / "config.json").write_text("{}"), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == [".entry.lock", "entry"]
    assert cache_mod.is_complete(tmp_path / "entry")


def test_concurrent_builds_run_once(tmp_path):
    builds = []

    def build(out: pathlib.Path) -> None:
        builds.append(out)
        time.sleep(0.3)
        (out / "config.json").write_text("{}")

    results = []
    threads = [
        threading.Thread(
            target=lambda: results.append(cache_mod.build_once(tmp_path / "e", build, {"k": 1}))
        )
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    assert results == [tmp_path / "e"] * 3
    assert (tmp_path / "e" / "config.json").is_file()


# ---------------------------------------------------------------- GGUF conversion


def _bytes_to_unicode() -> list[str]:
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


TOKENS = _bytes_to_unicode() + ["he", "ll", "hell", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll"]


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """The row order llama.cpp's converter gives Q/K of llama models (reference layout)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


_TO_GGUF = {v: k for k, v in gguf_convert._LAYER_NAMES.items()}


def _gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, *rest = hf_name.split(".")
        module, kind = ".".join(rest[:-1]), rest[-1]
        return f"blk.{layer}.{_TO_GGUF[module]}.{kind}"
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }[hf_name]


def _tiny_hf_model(arch: str, tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kwargs = dict(
        vocab_size=len(TOKENS),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
        bos_token_id=len(TOKENS) - 2,
        eos_token_id=len(TOKENS) - 1,
    )
    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kwargs))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**kwargs))
    return model.eval()


def _write_gguf(path: pathlib.Path, model, arch: str, qtype=None) -> dict[str, np.ndarray]:
    """Write ``model`` as llama.cpp would; return the HF tensors the GGUF stores (dequantized)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * (len(TOKENS) - 3) + [3] * 3)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_eot_token_id(len(TOKENS) - 3)
    writer.add_chat_template(CHAT_TEMPLATE)
    expected = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = tensor.float().numpy()
        stored = w
        if arch == "llama" and ".q_proj." in name:
            stored = _llama_cpp_permute(w, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            stored = _llama_cpp_permute(w, cfg.num_key_value_heads)
        if qtype is not None and w.ndim == 2:
            raw = gguf.quants.quantize(stored, qtype)
            writer.add_tensor(_gguf_name(name), raw, raw_dtype=qtype)
            w = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
        else:
            writer.add_tensor(_gguf_name(name), np.ascontiguousarray(stored))
        expected[name] = w
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("llama", True), ("qwen2", True)])
def test_gguf_matches_transformers(tmp_path, cache_dir, arch, tied):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = _tiny_hf_model(arch, tied)
    _write_gguf(tmp_path / "tiny.gguf", model, arch)
    out = resolve_model_path(str(tmp_path / "tiny.gguf"))
    assert out.parent.parent == cache_dir
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [type(model).__name__]
    assert config["tie_word_embeddings"] is tied
    assert config["rms_norm_eps"] == 1e-5
    assert load_generation_eos(out) == {len(TOKENS) - 1, len(TOKENS) - 3}

    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 200, 256, 258, 7, 30, 99]])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, model(ids).logits, rtol=0, atol=1e-5)

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.convert_ids_to_tokens(tok.encode("hello", add_special_tokens=False)) == [
        "hell",
        "o",
    ]


def test_gguf_quantized_and_sharded(tmp_path, cache_dir, monkeypatch):
    model = _tiny_hf_model("llama", tied=False)
    expected = _write_gguf(tmp_path / "q.gguf", model, "llama", gguf.GGMLQuantizationType.Q8_0)
    monkeypatch.setattr(gguf_convert, "SHARD_BYTES", 40_000)
    out = resolve_model_path(str(tmp_path / "q.gguf"))
    assert (out / "model.safetensors.index.json").is_file()
    loaded = dict(iter_safetensors(out))
    assert loaded.keys() == expected.keys()
    for name, w in expected.items():
        assert loaded[name].dtype == torch.float32
        np.testing.assert_array_equal(loaded[name].numpy(), w, err_msg=name)


def test_gguf_cached_by_file_identity(tmp_path, cache_dir, monkeypatch):
    model = _tiny_hf_model("qwen2", tied=True)
    path = tmp_path / "m.gguf"
    _write_gguf(path, model, "qwen2")
    first = resolve_model_path(str(path))

    def fail(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_convert, "convert_gguf", fail)
    assert resolve_model_path(str(path)) == first
    assert resolve_model_path(str(tmp_path)) == first
    monkeypatch.undo()
    monkeypatch.setenv("MINISGL_CACHE", str(cache_dir))
    _write_gguf(path, _tiny_hf_model("llama", tied=True), "llama")
    second = resolve_model_path(str(path))
    assert second != first
    assert json.loads((second / "config.json").read_text())["model_type"] == "llama"


def test_gguf_errors(tmp_path, cache_dir):
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ModelLoadError, match="junk.gguf"):
        resolve_model_path(str(tmp_path / "junk.gguf"))
    writer = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="architecture 'bert'.*not supported"):
        resolve_model_path(str(tmp_path / "bert.gguf"))
    assert not any(p.is_dir() for p in (cache_dir / "gguf").iterdir())


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for heads in (1, 2, 8):
        permuted = _llama_cpp_permute(w, heads)
        assert not np.array_equal(permuted, w)
        np.testing.assert_array_equal(gguf_convert.unpermute_rope_rows(permuted, heads), w)


def test_unknown_gguf_tensor_name():
    assert (
        gguf_convert.hf_tensor_name("blk.3.ffn_down.weight")
        == "model.layers.3.mlp.down_proj.weight"
    )
    assert gguf_convert.hf_tensor_name("rope_freqs.weight") is None
    with pytest.raises(ModelLoadError, match="blk.0.ffn_gate_exps.weight"):
        gguf_convert.hf_tensor_name("blk.0.ffn_gate_exps.weight")


# ---------------------------------------------------------------- built-in default model


def test_default_model_answers_paris(monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(None)
    assert path == resolve_model_path(DEFAULT_MODEL)

    def no_network(*args, **kwargs):
        raise AssertionError("the cached default model must not be downloaded again")

    monkeypatch.setattr(default_model, "_download_wheel", no_network)
    monkeypatch.setattr(default_model, "convert_gguf", no_network)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_path(None) == path
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert 2 in load_generation_eos(path)

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, local_files_only=True
    ).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=2
        )
    answer = tok.decode(out[0, len(ids) :], skip_special_tokens=True)
    assert answer.strip() == "The capital of France is Paris."
