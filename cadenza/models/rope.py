"""RoPE frequencies: plain, and Llama 3's "llama3", "linear", YaRN ("yarn"), Phi-3's
"longrope" and "dynamic" NTK scaling.

Every scaling is fixed when the model loads, from the longest context the engine will serve
(max_positions): one cos/sin cache for the model's life. transformers re-derives longrope's
and dynamic's frequencies from each forward's length, so a conversation that grows past the
threshold has its earlier keys rotated one way and its later ones another; a fixed choice
keeps every cached key consistent with every query. Against transformers: longrope takes its
long factors when the served context exceeds original_max_position_embeddings (as
transformers does for a sequence that long), its short ones otherwise; dynamic NTK keeps the
plain base up to the model's max_position_embeddings (as transformers does) and past it
takes the base for max_positions (transformers': for the sequence's length so far).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from cadenza.models.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig, max_positions: int) -> torch.Tensor:
    """[head_dim / 2] fp32 inverse frequencies after any scaling the config asks for, for a
    model serving contexts up to max_positions."""
    dim = cfg.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
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
    if kind == "yarn":
        return _yarn(inv_freq, scaling, cfg)
    if kind == "longrope":
        long = max_positions > _original_length(cfg)
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return inv_freq / factors
    if kind == "dynamic":
        if max_positions <= cfg.max_position_embeddings:
            return inv_freq
        factor = float(scaling["factor"])
        stretch = factor * max_positions / cfg.max_position_embeddings - (factor - 1)
        return 1.0 / ((cfg.rope_theta * stretch ** (dim / (dim - 2))) ** exponents)
    raise ValueError(f"unsupported rope scaling type {kind!r}; supported: {', '.join(ROPE_SCALINGS)}")


ROPE_SCALINGS = ("llama3", "linear", "yarn", "longrope", "dynamic")


def _original_length(cfg: ModelConfig) -> int:
    scaling = cfg.rope_scaling or {}
    return int(scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings)


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


def _yarn(inv_freq: torch.Tensor, s: dict, cfg: ModelConfig) -> torch.Tensor:
    """YaRN: dimensions that turn fewer than beta_slow times over the original context are
    interpolated (divided by `factor`), those that turn more than beta_fast times kept, a
    linear ramp between (the paper's "NTK-by-parts"); attention_scaling() adds its temperature."""
    factor, dim = float(s["factor"]), cfg.head_dim
    old_len = float(s.get("original_max_position_embeddings") or cfg.max_position_embeddings)
    fast, slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def dim_turning(turns: float) -> float:  # the dimension whose wavelength turns `turns` times
        return dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    low, high = dim_turning(fast), dim_turning(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def attention_scaling(cfg: ModelConfig) -> float:
    """The factor YaRN and longrope multiply cos and sin by (so q.k by its square); 1 for
    other kinds."""
    s = cfg.rope_scaling
    if s is not None and s["rope_type"] == "longrope":
        return _longrope_scaling(cfg, s)
    if s is None or s["rope_type"] != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return mscale(factor, float(s["mscale"])) / mscale(factor, float(s["mscale_all_dim"]))
    return mscale(factor)


def _longrope_scaling(cfg: ModelConfig, s: dict) -> float:
    """sqrt(1 + ln(factor) / ln(original length)), factor the context's growth (Phi-3's rule)."""
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    original = _original_length(cfg)
    factor = float(s.get("factor") or cfg.max_position_embeddings / original)
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))


def local_cos_sin_cache(cfg: ModelConfig, max_positions: int) -> torch.Tensor | None:
    """Gemma 3's sliding layers' cache: their own base, unscaled; None for other families."""
    if cfg.local_rope_theta is None:
        return None
    return cos_sin_cache(replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=None), max_positions)


def cos_sin_cache(cfg: ModelConfig, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim]: cos of each frequency, then sin; fp32 (YaRN's scaling folded in,
    so every kernel that reads the cache applies it)."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inverse_frequencies(cfg, max_positions))
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_scaling(cfg)
