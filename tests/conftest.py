"""Shared fixtures: tiny random HF checkpoints built here, and the real SmolLM2 (loaded once)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run interpreted here; must precede their import
    os.environ.setdefault("TRITON_INTERPRET", "1")
# dtype="auto" is bf16 on CPUs with native bf16 dot products: the suite compares fp32 against
# transformers in fp32 on every machine (its servers and Ray workers inherit this too).
os.environ.setdefault("CADENZA_CPU_AUTO_DTYPE", "float32")

from cadenza.models.loader import DEFAULT_MODEL, resolve_model_path  # noqa: E402

TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=512)

# name -> (transformers config class, extra config fields)
TINY_CONFIGS = {
    "llama_mha": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)),
    "llama_gqa_tied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "llama_mqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False)),
    "qwen2_gqa_bias": (
        "Qwen2Config",
        dict(num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False, head_dim=16, hidden_size=96),
    ),
    "mistral_gqa": (
        "MistralConfig",
        dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None, tie_word_embeddings=False),
    ),
    "llama3_rope": (
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
}


def build_tiny_hf(kind: str, directory: Path, seed: int = 0) -> torch.nn.Module:
    """A random-weight HF model saved as an HF directory; weights scaled up so logits are peaked."""
    import transformers

    cls_name, extra = TINY_CONFIGS[kind]
    config = getattr(transformers, cls_name)(**{**TINY, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.15) + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, torch.nn.Module]]:
    cache: dict[str, tuple[Path, torch.nn.Module]] = {}

    def make(kind: str = "llama_gqa_tied") -> tuple[Path, torch.nn.Module]:
        if kind not in cache:
            directory = tmp_path_factory.mktemp(kind)
            cache[kind] = (directory, build_tiny_hf(kind, directory))
        return cache[kind]

    return make


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    return resolve_model_path(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def smollm(smollm_path: Path):  # noqa: ANN201 - an LLM
    from cadenza import LLM

    return LLM(DEFAULT_MODEL, num_blocks=2048)


@pytest.fixture(scope="session")
def hf_smollm(smollm_path: Path) -> torch.nn.Module:
    """transformers' own GGUF loader on the same file: the oracle for SmolLM2."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        smollm_path.parent, gguf_file=smollm_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def ray_cluster() -> None:
    """One local Ray instance for the whole session (it takes ~15 s to start). Logical CPUs
    exceed the 2 physical ones so TP x PP = 4 workers can be placed. Started as `cadenza serve`
    starts its own: listening on loopback only."""
    import ray

    from cadenza.actors.local_ray import init_local_ray

    init_local_ray(8, logging_level="error")
    yield
    ray.shutdown()
