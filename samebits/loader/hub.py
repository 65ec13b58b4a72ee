"""Hugging Face model ids (``"org/name"``) -> a local model directory, with ``huggingface_hub``.

The local HF cache is looked at first (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``~/.cache/huggingface/hub``, or ``download_dir``; revision ``main`` unless another is given), as
vLLM does. When the model is not there and the hub is reachable (``HF_HUB_OFFLINE`` unset), its
config, tokenizer and safetensors files are downloaded into that cache with progress bars.
Otherwise the error names the id, the cache folder looked in and the command that fetches it.
"""

from __future__ import annotations

import re
from pathlib import Path

from samebits.config import ModelFormatError

# what a model directory needs: config, tokenizer, chat template, weights (no other formats)
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_repo_id(spec: str) -> bool:
    """Whether ``spec`` has the form of a hub id (``org/name``), not of a file path."""
    return bool(_REPO_ID.match(spec)) and not spec.endswith((".gguf", ".json"))


def resolve(repo_id: str, revision: str | None = None, download_dir: str | None = None) -> Path:
    """The snapshot directory of ``repo_id`` at ``revision`` (default ``main``): from the cache,
    or downloaded into it. Raises ``ModelFormatError`` naming the fix when neither works."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    kwargs = dict(revision=revision or "main", cache_dir=download_dir,
                  allow_patterns=ALLOW_PATTERNS)
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, **kwargs))
    except LocalEntryNotFoundError:
        pass
    except Exception as e:  # noqa: BLE001 -- an invalid id, a broken cache entry
        raise _not_found(repo_id, revision, download_dir, e) from None
    try:
        return Path(snapshot_download(repo_id, **kwargs))
    except Exception as e:  # noqa: BLE001 -- offline, unknown or gated repo, network errors
        raise _not_found(repo_id, revision, download_dir, e) from None


def cache_folder(repo_id: str, download_dir: str | None = None) -> Path:
    """Where the HF cache keeps ``repo_id``."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name
    root = Path(download_dir) if download_dir else Path(constants.HF_HUB_CACHE)
    return root / repo_folder_name(repo_id=repo_id, repo_type="model")


def _not_found(repo_id: str, revision: str | None, download_dir: str | None, cause: Exception
               ) -> ModelFormatError:
    command = f"hf download {repo_id}"
    if revision:
        command += f" --revision {revision}"
    if download_dir:
        command += f" --cache-dir {download_dir}"
    reason = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    return ModelFormatError(
        f"{repo_id!r} is not a local path, and the Hugging Face model {repo_id} (revision "
        f"{revision or 'main'}) is not in the cache at {cache_folder(repo_id, download_dir)} and "
        f"could not be downloaded ({reason}). Fetch it with: {command}")
