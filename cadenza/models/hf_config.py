"""An HF model directory's config (config.json, and generation_config.json's end-of-turn
tokens), without torch."""

from __future__ import annotations

import json
from pathlib import Path

from cadenza.models.config import ModelConfig


def read_hf_config(directory: Path) -> ModelConfig:
    path = directory / "config.json"
    if not path.is_file():
        raise ValueError(f"{directory}: no config.json; expected an HF model directory or a .gguf file")
    cfg = json.loads(path.read_text())
    generation = directory / "generation_config.json"
    if generation.is_file():  # chat models list their end-of-turn tokens here
        eos = json.loads(generation.read_text()).get("eos_token_id")
        if eos is not None:
            cfg = {**cfg, "eos_token_id": eos}
    return ModelConfig.from_hf(cfg, source=str(path))
