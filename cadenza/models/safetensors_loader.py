"""HF checkpoint directories: config.json plus model.safetensors or a sharded index."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from cadenza.models.hf_config import read_hf_config  # noqa: F401 - this module's API


def weight_files(directory: Path) -> list[Path]:
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            raise ValueError(f"{index}: shard files missing: {missing}")
        return [directory / s for s in shards]
    raise ValueError(f"{directory}: no model.safetensors or model.safetensors.index.json")


def iter_safetensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in weight_files(directory):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
