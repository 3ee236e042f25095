"""One Llama-family decoder (Llama 2/3.x, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Projections are fused (q|k|v and gate|up) so a decode step is few, large matmuls; every
other op goes through cadenza.kernels.ops so the Triton kernels slot in unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from cadenza.kernels import cpu_native, ops
from cadenza.kernels.metadata import AttentionMetadata
from cadenza.models.config import ModelConfig
from cadenza.models.rope import cos_sin_cache
from cadenza.models.tp import SINGLE, TPGroup

KVCache = tuple[torch.Tensor, torch.Tensor]


# Rows up to which Linear on the CPU (fp32) uses the C GEMV of cpu_native, which reads W once
# for all rows: single-stream decode, k + 1 speculative verification, small decode batches.
FEW_ROWS = 8
# Rows up to which a packed Linear uses oneDNN: larger decode batches.
SMALL_BATCH_ROWS = 64


class Linear(nn.Module):
    """y = x W^T + b with W stored transposed, [in, out].

    Measured here (MKL, 2 cores): x @ W_t streams a decode step's weights at ~25 GB/s, while
    F.linear on the [out, in] layout manages ~13 GB/s; at large M both are compute-bound alike.
    Between the two, MKL's GEMM is poor: 5 rows cost ~4x one row (it repacks W every call).
    On the CPU in fp32, prepare_cpu_paths re-lays W out as [out, in] (weight_t becomes a view;
    MKL is as fast either way at large M) for two faster paths:
    - up to FEW_ROWS rows (single-stream decode, k + 1 verification): the C GEMV of cpu_native
      reads W once for all rows, at ~28 GB/s where x @ W_t manages 13-22 (two cores);
    - up to SMALL_BATCH_ROWS rows: a oneDNN-packed copy (doubling the weights' memory): 5 rows
      of the 576x3072 MLP weight take 0.37 ms vs 0.79 ms, the LM head 12.8 vs 36.7 ms (one core).
    The figures are `/tmp` microbenchmarks quoted in the issue notes.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # Row-parallel under tensor parallelism: partial sums are all-reduced across ranks.
        self.reduce: TPGroup = SINGLE
        self.packed: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None  # W as [out, in], under the weight_t view
        self.few_rows_kernel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.few_rows_kernel and rows <= FEW_ROWS and ops.backend() == "cpu":
            y = cpu_native.linear_few_rows(x, self.rows, self.bias)
        elif self.packed is not None and 1 < rows <= SMALL_BATCH_ROWS:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        elif self.bias is None:
            y = x @ self.weight_t
        else:
            y = torch.addmm(self.bias, x, self.weight_t)
        return self.reduce.all_reduce(y)

    def prepare_cpu_paths(self, few_rows_kernel: bool, packed: bool) -> None:
        """W as [out, in] under the weight_t view; the few-rows C GEMV and/or the oneDNN copy."""
        rows = self.weight_t.detach().t().contiguous()
        self.weight_t.data, self.rows = rows.t(), rows
        self.few_rows_kernel = few_rows_kernel
        if packed:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(rows, 8)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        q, k = ops.rotary(q, k, cos_sin)
        ops.write_kv(k, v, kv[0], kv[1], meta.slot_mapping)
        out = ops.paged_attention(q, kv[0], kv[1], meta, self.scale)
        return self.o_proj(out.reshape(tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: torch.Tensor,
        kv: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = x, ops.rms_norm(x, self.input_layernorm, self.eps)
        else:
            h, residual = ops.fused_add_rms_norm(x, residual, self.input_layernorm, self.eps)
        h = self.self_attn(h, cos_sin, kv, meta)
        h, residual = ops.fused_add_rms_norm(h, residual, self.post_attention_layernorm, self.eps)
        return self.mlp(h), residual

    def decode_weights(self) -> list[torch.Tensor | None] | None:
        """The weights csrc/decode_layer.c takes, in its order, or None where they are not
        plain [out, in] fp32 (see Linear.prepare_cpu_paths: TP 1, not quantized)."""
        attn, mlp = self.self_attn, self.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(linear.rows is None for linear in linears):
            return None
        weights = [self.input_layernorm, self.post_attention_layernorm, attn.qkv_proj.rows, attn.qkv_proj.bias]
        weights += [attn.o_proj.rows, attn.o_proj.bias, mlp.gate_up_proj.rows, mlp.down_proj.rows]
        return [None if w is None else w.detach() for w in weights]


class LlamaForCausalLM(nn.Module):
    """The whole model, or after cadenza.models.shard one rank's part: a pipeline stage
    (a run of layers) and a tensor-parallel slice of each."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        # Given storage, so no random init runs: on the meta device that init alone imports
        # torch._refs, seconds of every worker's start-up.
        embed = torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=embed)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        # Tied models get their own transposed copy for the faster decode layout (see Linear).
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("cos_sin", cos_sin_cache(cfg, max_positions), persistent=False)
        self.is_first_stage = self.is_last_stage = True
        self.tp: TPGroup = SINGLE
        self.vocab_start = 0  # this rank's first vocab row (vocab-parallel embedding)
        # All of this stage's layers in one C call for one-token steps on the CPU (bind_decode_stack).
        self.decode_stack: cpu_native.DecodeStackKernel | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] for a flattened batch of T tokens (single stage)."""
        x, residual = self.run_layers(self.embed(input_ids), None, positions, kv_caches, meta)
        return self.final_norm(x, residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.embed_tokens.num_embeddings)
        x = self.embed_tokens(local.clamp(0, self.embed_tokens.num_embeddings - 1))
        x[outside] = 0
        return self.tp.all_reduce(x)

    def run_layers(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This stage's layers; (x, residual) is what the next pipeline stage continues from."""
        cos_sin = self.cos_sin[positions]
        if self.decode_stack is not None and x.shape[0] == 1 and ops.backend() == "cpu":
            slot, seq_len = int(meta.slot_mapping[0]), meta.seq_lens[0]
            return self.decode_stack(x, residual, cos_sin, kv_caches, slot, meta.block_tables[0], seq_len)
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos_sin, kv, meta)
        return x, residual

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        x, _ = ops.fused_add_rms_norm(x, residual, self.norm, self.cfg.rms_norm_eps)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, vocab] fp32; under TP each rank's vocab slice is gathered (every rank must call)."""
        logits = self.tp.all_gather_last(self.lm_head(hidden).float())
        return logits[:, : self.cfg.vocab_size]

    def prepare_cpu_paths(self) -> None:
        """CPU fp32 only (see Linear): the C GEMV for one row where this host can build it, and
        oneDNN copies (doubling the weights' memory) for 2..64 rows."""
        on_cpu_fp32 = self.norm.device.type == "cpu" and self.norm.dtype == torch.float32
        if not on_cpu_fp32:
            return
        few_rows, packed = cpu_native.gemv_available(), torch.backends.mkldnn.is_available()
        for module in self.modules():
            if isinstance(module, Linear) and module.weight_t.numel() > 1:
                module.prepare_cpu_paths(few_rows, packed)
        if few_rows and self.tp.size == 1 and cpu_native.decode_layers_available():
            self.bind_decode_stack()

    def bind_decode_stack(self) -> None:
        """One-token steps run this stage's layers in csrc/decode_layer.c: the same math as
        DecoderLayer.forward with ~60 fewer torch calls a layer, and one ctypes call a step."""
        weights = [layer.decode_weights() for layer in self.layers]
        if not weights or any(w is None for w in weights):
            return
        attn, mlp = self.layers[0].self_attn, self.layers[0].mlp
        dims = [self.cfg.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.down_proj.rows.shape[1], 0]
        self.decode_stack = cpu_native.DecodeStackKernel(weights, dims, self.cfg.rms_norm_eps, attn.scale)

    def weight_bytes(self) -> int:
        """Bytes of distinct weights (a tied lm_head counted once): what a decode step streams."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        return total - (self.lm_head.weight_t.nbytes if self.cfg.tie_word_embeddings else 0)
