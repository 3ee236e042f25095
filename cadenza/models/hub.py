"""Models named by Hugging Face Hub id (`Qwen/Qwen3-0.6B`), as vLLM takes them: the snapshot in
the local Hub cache, fetched into it first unless the Hub is off (HF_HUB_OFFLINE=1), and then
loaded like any HF directory. Only what serving needs is fetched: the config, the tokenizer
and chat template, and the safetensors weights (not the .bin / .pt copies many repos carry)."""

from __future__ import annotations

import os
import re
from pathlib import Path

# org/name, as the Hub spells repository ids (letters, digits, '-', '_', '.').
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
SNAPSHOT_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt"]
_TRUE = ("1", "true", "yes", "on")


def looks_like_hub_id(name: str) -> bool:
    return HUB_ID.fullmatch(name) is not None


def hub_snapshot(repo_id: str) -> Path:
    """The local folder of `repo_id`'s snapshot (main revision). HF_HUB_CACHE and
    HF_HUB_OFFLINE are read at call time, so a process can point at a cache it was given."""
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE
    try:
        folder = snapshot_download(
            repo_id,
            cache_dir=os.environ.get("HF_HUB_CACHE") or None,
            local_files_only=offline,
            allow_patterns=SNAPSHOT_FILES,
            revision=os.environ.get("CADENZA_HUB_REVISION") or None,
        )
    except Exception as e:  # not on the Hub, no network, gated, not in the cache when offline
        where = "in the local Hub cache (HF_HUB_OFFLINE is set)" if offline else "on the Hugging Face Hub"
        raise ValueError(
            f"model {repo_id!r}: not a local path, and not found {where}: {type(e).__name__}: {e}"
        ) from None
    return Path(str(folder))
