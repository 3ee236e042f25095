"""Builds the speculative proposer an engine's config asks for."""

from __future__ import annotations

import torch.nn as nn

from cadenza.actors.draft_proposer import DraftModelProposer
from cadenza.actors.ngram_proposer import NgramProposer
from cadenza.actors.spec_proposal import Proposer
from cadenza.config import EngineConfig
from cadenza.models.config import ModelConfig
from cadenza.models.loader import load_model


def build_proposer(
    config: EngineConfig, target: ModelConfig, max_model_len: int, num_blocks: int, kv_share_place: str | None = None
) -> Proposer | None:
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec)
    device = "cuda" if config.device.startswith("cuda") else config.device
    draft = load_model(spec.model, config.weight_format, device).model
    _check_compatible(spec.model, draft.cfg, target, max_model_len)
    if spec.draft_num_layers is not None:
        # A truncated copy: the first layers, then the model's own norm and head.
        draft.layers = nn.ModuleList(list(draft.layers)[: spec.draft_num_layers])
    return DraftModelProposer(draft, num_blocks, config.block_size, kv_share_place)


def _check_compatible(name: str, draft: ModelConfig, target: ModelConfig, max_model_len: int) -> None:
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft model {name!r} has a vocabulary of {draft.vocab_size} tokens but the target has "
            f"{target.vocab_size}; a draft must share the target's tokenizer"
        )
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(
            f"draft model {name!r} handles {draft.max_position_embeddings} positions, fewer than "
            f"max_model_len={max_model_len}; lower max_model_len"
        )
