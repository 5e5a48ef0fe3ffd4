"""Downloading a model from the Hugging Face Hub (only when the network allows)."""

from __future__ import annotations

import os
import pathlib

from minisgl.models.loader.errors import ModelLoadError

ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.jinja",
    "*.model",
    "*.txt",
    "*.tiktoken",
]
METADATA_TIMEOUT_S = 10.0
_UNREACHABLE = {
    "LocalEntryNotFoundError",
    "ConnectError",
    "ConnectTimeout",
    "ConnectionError",
    "TimeoutException",
}


def download_from_hub(repo_id: str) -> pathlib.Path:
    """A local snapshot of Hub repository ``repo_id`` (config, tokenizer, safetensors).

    Uses the local Hugging Face cache when the repository is there (always so when
    HF_HUB_OFFLINE is set). Any failure — no huggingface_hub, no network, unknown or gated
    repository — raises ModelLoadError with a one-line message.
    """
    try:
        import huggingface_hub
    except ImportError as e:
        raise ModelLoadError(
            f"{repo_id!r} is not a local path, and huggingface_hub is not installed to download "
            "it from the Hugging Face Hub (pip install huggingface_hub)"
        ) from e
    try:
        folder = huggingface_hub.snapshot_download(
            repo_id,
            allow_patterns=ALLOW_PATTERNS,
            etag_timeout=METADATA_TIMEOUT_S,
        )
    except Exception as e:
        raise ModelLoadError(_describe(repo_id, e)) from e
    path = pathlib.Path(folder)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"Hugging Face Hub repository {repo_id!r} has no config.json")
    return path


def _describe(repo_id: str, error: Exception) -> str:
    kind = type(error).__name__
    names = {type(c).__name__ for c in _causes(error)}
    if "RepositoryNotFoundError" in names:
        return f"model {repo_id!r} is neither a local path nor a Hugging Face Hub repository"
    if "GatedRepoError" in names:
        return f"Hugging Face Hub repository {repo_id!r} is gated; log in (hf auth login) first"
    if "OfflineModeIsEnabled" in names or _offline():
        return (
            f"model {repo_id!r} is not a local path and is not in the Hugging Face cache, "
            "and HF_HUB_OFFLINE is set"
        )
    if names & _UNREACHABLE:
        return (
            f"cannot download model {repo_id!r}: the Hugging Face Hub is unreachable "
            "(no network?) and it is not in the local cache; pass a local directory or .gguf file"
        )
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else kind
    return f"cannot download model {repo_id!r} from the Hugging Face Hub: {kind}: {first_line}"


def _causes(error: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
