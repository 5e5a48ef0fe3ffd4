"""Command line of ``python -m minisgl``."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

DEFAULT_MODEL_NAME = "smollm2-135m"
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class ServerArgs:
    """Everything the launcher and its children need to know, resolved once from the CLI."""

    model: str | None = None
    cache: str = "radix"
    host: str = "127.0.0.1"
    port: int = 1919
    tp: int = 1
    device: str = "auto"
    dtype: str = "auto"
    weight_dtype: str = "auto"
    kv_dtype: str = "auto"
    page_size: int = 1
    num_pages: int | None = None
    memory_ratio: float | None = None
    kv_memory_gb: float | None = None
    max_seq_len: int | None = None
    max_running_requests: int = 64
    max_prefill_length: int = 2048
    max_queued_requests: int | None = None
    mixed: bool = True
    attn: str = "auto"
    served_model_name: str | None = None
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    shell: bool = False
    log_level: str = "info"
    debug_invariant: bool = False

    @property
    def model_name(self) -> str:
        """The name clients use in ``model`` and that ``/v1/models`` lists."""
        if self.served_model_name:
            return self.served_model_name
        return self.model or DEFAULT_MODEL_NAME

    @property
    def accepted_model_names(self) -> frozenset[str]:
        names = {self.model_name}
        if self.model:
            names.add(self.model)
        return frozenset(names)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text}")
    return value


def _ratio(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0.0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minisgl",
        description="Serve a language model over an OpenAI-compatible HTTP API "
        "(or chat with it in the terminal with --shell).",
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        default=None,
        help="local Hugging Face directory, .gguf file or Hub id; "
        f"default: the built-in {DEFAULT_MODEL_NAME} (SmolLM2-135M-Instruct)",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="name clients pass as 'model' and /v1/models lists (default: the --model value)",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV dtype; auto: the engine picks for the device (default: auto)",
    )
    g.add_argument(
        "--weight-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="CPU, float32 activations: how linear weights are stored; auto: bfloat16 when "
        "--dtype is auto and the compiled kernels are available (default: auto)",
    )
    g.add_argument(
        "--kv-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="KV cache dtype; auto: the model dtype. bfloat16 under a float32 model (CPU) "
        "halves KV memory; greedy outputs may then differ slightly (default: auto)",
    )
    g.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="auto: cuda when available, else cpu (default: auto)",
    )
    g.add_argument(
        "--attn",
        default="auto",
        help="attention backend: auto, torch or flashinfer, or a 'prefill,decode' pair "
        "(default: auto)",
    )
    g.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel ranks (default: 1)")
    g.add_argument(
        "--max-seq-len",
        type=_positive_int,
        default=None,
        help="context length (default: the model's max_position_embeddings)",
    )

    g = p.add_argument_group("KV cache and scheduling")
    g.add_argument(
        "--cache",
        default="radix",
        choices=["radix", "naive"],
        help="prefix cache: radix shares prompt prefixes across requests, naive shares nothing "
        "(default: radix)",
    )
    g.add_argument(
        "--page-size", type=_positive_int, default=1, help="tokens per KV page (default: 1)"
    )
    kv = g.add_mutually_exclusive_group()
    kv.add_argument(
        "--num-pages",
        type=_positive_int,
        default=None,
        help="KV pool size in pages (default: from the memory budget)",
    )
    kv.add_argument(
        "--memory-ratio",
        type=_ratio,
        default=None,
        help="fraction of free GPU memory for weights + KV pool (GPU; default 0.85)",
    )
    kv.add_argument(
        "--kv-memory-gb",
        type=_positive_float,
        default=None,
        help="KV pool budget in GiB (CPU default chosen by the engine)",
    )
    g.add_argument(
        "--max-running-requests",
        type=_positive_int,
        default=64,
        help="requests decoded together at most (default: 64)",
    )
    g.add_argument(
        "--max-prefill-length",
        type=_positive_int,
        default=2048,
        help="prompt tokens computed per forward at most; longer prompts are chunked "
        "(default: 2048)",
    )
    g.add_argument(
        "--max-queued-requests",
        type=_non_negative_int,
        default=None,
        help="waiting requests beyond the running ones before new ones get 503 (default: no limit)",
    )
    g.add_argument(
        "--no-mixed",
        dest="mixed",
        action="store_false",
        help="never put prefill chunks and decodes in the same forward",
    )
    g.add_argument(
        "--debug-invariant",
        action="store_true",
        help="check the KV cache invariant whenever the scheduler goes idle",
    )

    g = p.add_argument_group("HTTP server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    g.add_argument(
        "--port", type=_port, default=1919, help="TCP port; 0 picks a free one (default: 1919)"
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* and /abort "
        "(when unset: $MINISGL_API_KEY if set, else no key)",
    )
    g.add_argument(
        "--max-body-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies are refused with 413 (default: 16 MiB)",
    )

    g = p.add_argument_group("other")
    g.add_argument(
        "--shell",
        action="store_true",
        help="chat in the terminal instead of serving HTTP (/reset clears history, /exit quits)",
    )
    g.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity of all processes (default: info)",
    )
    return p


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    ns = build_parser().parse_args(argv)
    if ns.api_key is None:
        ns.api_key = os.environ.get("MINISGL_API_KEY") or None
    return ServerArgs(**vars(ns))
