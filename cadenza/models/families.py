"""Which model class builds each HF architecture: the Llama decoder unless a family has
its own (architectures a config may name are ModelConfig's SUPPORTED_ARCHITECTURES)."""

from __future__ import annotations

from cadenza.models.config import ModelConfig
from cadenza.models.gemma import GemmaForCausalLM
from cadenza.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    return MODEL_CLASSES.get(cfg.architecture, LlamaForCausalLM)
