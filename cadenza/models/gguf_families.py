"""What a GGUF's metadata says for the families beyond Llama's shape (Gemma 2/3, Phi-3),
under llama.cpp's own keys and conventions, as ModelConfig fields; torch-free like
gguf_reader.py, which calls it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from cadenza.models.gguf_file import GGUFFile

# llama.cpp's layer patterns: Gemma 2 slides every other layer (the even ones), Gemma 3 five
# layers in six; its 27B models scale queries by hidden / heads rather than head_dim (their
# query_pre_attn_scalar), told apart by their layer count.
_SLIDING_EVERY = {"gemma2": 2, "gemma3": 6}
_LAYERS_OF_27B = {"gemma2": 46, "gemma3": 62}
Meta = Callable[..., Any]


def gemma_fields(arch: str, meta: Meta, hidden: int, heads: int, layers: int) -> dict[str, Any]:
    """Gemma's extras. Its norm weights are stored with the 1 already added (llama.cpp's
    converter folds Gemma's (1 + w) in), so no norm_offset here."""
    every = _SLIDING_EVERY[arch]
    window = meta("attention.sliding_window")
    fields: dict[str, Any] = dict(
        sandwich_norms=True,
        hidden_act="gelu_tanh",
        embed_scale=hidden**0.5,
        attn_softcap=meta("attn_logit_softcapping"),
        final_softcap=meta("final_logit_softcapping"),
        sliding_window=window,
        sliding_layers=tuple(i for i in range(layers) if i % every < every - 1) if window else (),
    )
    scale = meta("attention.scale")  # GGUF's attention-scale key, where a file states one
    if scale:
        fields["query_scale"] = scale**-2
    elif layers == _LAYERS_OF_27B[arch]:
        fields["query_scale"] = hidden // heads
    if arch == "gemma3":  # its sliding layers turn at their own base (llama.cpp's default 10000)
        fields["local_rope_theta"] = meta("rope.freq_base_swa", 10000.0)
    return fields


def longrope_scaling(reader: GGUFFile, meta: Meta) -> dict[str, Any] | None:
    """Phi-3's longrope, which llama.cpp stores as two factor tensors and scaling keys."""
    factors = {t.name: t for t in reader.tensors if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")}
    if len(factors) < 2:
        return None

    def values(name: str) -> list[float]:
        return [float(x) for x in np.asarray(factors[name].data, dtype=np.float32)]

    return {
        "rope_type": "longrope",
        "long_factor": values("rope_factors_long.weight"),
        "short_factor": values("rope_factors_short.weight"),
        "original_max_position_embeddings": meta("rope.scaling.original_context_length"),
        "attention_factor": meta("rope.scaling.attn_factor"),
    }
