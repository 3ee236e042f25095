"""RoPE frequencies, including Llama 3's "llama3" and plain "linear" scaling."""

from __future__ import annotations

import math

import torch

from cadenza.models.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] fp32 inverse frequencies after any scaling the config asks for."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if cfg.rope_freq_factors is not None:
        return inv_freq / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    raise ValueError(f"unsupported rope scaling type {kind!r}; supported: llama3, linear")


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Long wavelengths are divided by `factor`, short ones kept, the band between blended."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def cos_sin_cache(cfg: ModelConfig, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim]: cos of each frequency, then sin; fp32."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inverse_frequencies(cfg))
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
