"""Gemma 2 and Gemma 3 (text): the Llama blocks with Gemma's differences.

- "sandwich" norms: the attention's output and the MLP's output are RMS-normalised before
  they join the residual stream, and the MLP's input has a norm of its own;
- RMSNorm multiplies by (1 + w): the 1 is added to every norm weight at load
  (ModelConfig.norm_offset), so the shared norm kernels run unchanged;
- the GeGLU gate (gelu_tanh), the embedding scaled by sqrt(hidden), attention scaled by
  query_pre_attn_scalar, soft-capped scores and logits (Gemma 2), sliding layers between the
  global ones, and Gemma 3's q/k norms and second RoPE base: ModelConfig fields the shared
  Attention, MLP and LlamaForCausalLM read.
"""

from __future__ import annotations

import torch
from torch import nn

from cadenza.kernels.attention.metadata import AttentionMetadata
from cadenza.kernels.ops import Kernels
from cadenza.models.config import ModelConfig
from cadenza.models.llama import DecoderLayer, KVCache, LlamaForCausalLM


class GemmaDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__(cfg, index)
        self.pre_feedforward_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.post_feedforward_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: torch.Tensor,
        kv: KVCache,
        meta: AttentionMetadata,
        kernels: Kernels,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = x, kernels.rms_norm(x, self.input_layernorm, self.eps)
        else:
            h, residual = kernels.fused_add_rms_norm(x, residual, self.input_layernorm, self.eps)
        h = kernels.rms_norm(self.self_attn(h, cos_sin, kv, meta, kernels), self.post_attention_layernorm, self.eps)
        h, residual = kernels.fused_add_rms_norm(h, residual, self.pre_feedforward_layernorm, self.eps)
        return kernels.rms_norm(self.mlp(h, kernels), self.post_feedforward_layernorm, self.eps), residual


class GemmaForCausalLM(LlamaForCausalLM):
    decoder_layer = GemmaDecoderLayer
