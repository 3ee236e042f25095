"""GGUF files: config from metadata, tensors under HF names and layouts, kept in their
stored format (kernels/quant/gguf_blocks.py) or dequantized to fp32."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from cadenza.kernels.quant.gguf_blocks import KEPT_TYPES, packed_from_gguf
from cadenza.kernels.quant.weight import PackedWeight
from cadenza.models.config import ModelConfig

Q = gguf.GGMLQuantizationType
# Types gguf's numpy dequantizer handles and we test or trust; anything else is refused by name.
SUPPORTED_TYPES = {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K}
# GGUF architecture -> HF architecture. Mistral files say "llama".
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class _PlainArrayReader(gguf.GGUFReader):
    """The gguf reader, parsing from a plain ndarray view of its memory map.

    The reader slices `self.data` once or more per metadata value (SmolLM2 has ~100k vocabulary
    and merge strings); on an `np.memmap` each slice runs the subclass's Python hooks, which made
    parsing 6.4 s, against 2.4 s on the plain view of the same mapped bytes."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        self._plain = mapped.view(np.ndarray)  # the view keeps the map alive as its base


def open_gguf(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        return _PlainArrayReader(str(path))
    except Exception as e:  # the reader raises several types on garbage; report them as one
        raise ValueError(f"{path}: not a valid GGUF file ({type(e).__name__}: {e})") from e


def field_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_gguf_config(reader: gguf.GGUFReader, path: Path) -> ModelConfig:
    arch = field_value(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCHITECTURES)}")

    def meta(key: str, default: Any = None) -> Any:
        return field_value(reader, f"{arch}.{key}", default)

    heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    names = {t.name for t in reader.tensors}
    return ModelConfig(
        architecture=_ARCHITECTURES[arch],
        vocab_size=meta("vocab_size") or len(field_value(reader, "tokenizer.ggml.tokens")),
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"),
        num_layers=meta("block_count"),
        num_heads=heads,
        num_kv_heads=meta("attention.head_count_kv") or heads,
        head_dim=meta("attention.key_length") or hidden // heads,
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=meta("rope.freq_base", 10000.0),
        max_position_embeddings=meta("context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        rope_scaling=_rope_scaling(meta),
        rope_freq_factors=_freq_factors(reader),
        eos_token_ids=_eos_ids(reader),
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
    )


def _rope_scaling(meta: Any) -> dict[str, Any] | None:
    kind = meta("rope.scaling.type")
    if kind in (None, "none"):
        return None
    return {"rope_type": kind, "factor": meta("rope.scaling.factor", 1.0)}


def _freq_factors(reader: gguf.GGUFReader) -> tuple[float, ...] | None:
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            return tuple(float(x) for x in np.asarray(t.data, dtype=np.float32))
    return None


def _eos_ids(reader: gguf.GGUFReader) -> tuple[int, ...]:
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
    ids = [field_value(reader, k) for k in keys]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def iter_gguf_tensors(
    reader: gguf.GGUFReader, cfg: ModelConfig, path: Path, keep: bool = False
) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
    """HF-named tensors: fp32, or with `keep` every 2-D tensor of a type in KEPT_TYPES as a
    PackedWeight of its stored bytes. llama.cpp permutes Llama's Q/K rows for its RoPE; undo
    that here (on the rows, which blocks never cross)."""
    permuted = cfg.architecture != "Qwen2ForCausalLM"
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ValueError(f"{path}: tensor {t.name} has unsupported type {t.tensor_type.name}")
        name = hf_name(t.name, path)
        heads = None
        if permuted and t.name.split(".")[-2] in ("attn_q", "attn_k"):
            heads = cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads
        shape = tuple(int(d) for d in reversed(t.shape))
        if keep and len(shape) == 2 and t.tensor_type.name in KEPT_TYPES:
            packed = packed_from_gguf(t.tensor_type.name, t.data, *shape)
            yield name, packed if heads is None else packed.take_rows(unpermute_index(shape[0], heads))
            continue
        array = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
        if heads is not None:
            array = unpermute_rows(array, heads)
        yield name, torch.from_numpy(np.array(array, copy=True))


def unpermute_index(rows: int, num_heads: int) -> torch.Tensor:
    """The row order unpermute_rows produces, as indices into the stored rows."""
    return torch.from_numpy(unpermute_rows(np.arange(rows), num_heads).copy())


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's convert-time permute: [h, half, 2, ...] back to [h, 2, half, ...]."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(name: str, path: Path) -> str:
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"{path}: unexpected tensor {name!r}")
