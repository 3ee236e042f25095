"""A model's own sampling defaults (its generation_config.json), as vLLM applies them: a
request that leaves temperature, top_p, top_k, min_p or repetition_penalty unset gets the
model's value (Qwen3 asks for temperature 0.6, top_p 0.95, top_k 20, for instance), else the
API's default. Torch-free: the gateway reads them too."""

from __future__ import annotations

import json
from pathlib import Path

from cadenza.models.model_files import resolve_model_path

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(model: str, generation_config: str = "auto") -> dict[str, float]:
    """generation_config: "auto" reads the model directory's generation_config.json (a GGUF
    has none), "vllm" uses none (the API's defaults only), any other value is a folder
    holding a generation_config.json."""
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        path = resolve_model_path(model)
        folder = path if path.is_dir() else None
    else:
        folder = Path(generation_config)
        if not (folder / "generation_config.json").is_file():
            raise ValueError(f"generation_config {generation_config!r}: no generation_config.json in that folder")
    if folder is None or not (folder / "generation_config.json").is_file():
        return {}
    values = json.loads((folder / "generation_config.json").read_text())
    return {
        k: values[k]
        for k in SAMPLING_KEYS
        if isinstance(values.get(k), int | float) and not isinstance(values[k], bool)
    }
