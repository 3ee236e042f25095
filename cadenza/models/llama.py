"""One Llama-family decoder (Llama 2/3.x, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Projections are fused (q|k|v and gate|up) so a decode step is few, large matmuls; how each
projection's weight is stored and multiplied is its LinearMethod (cadenza.kernels.linear),
chosen at load time; every other op (norm, RoPE, SiLU, KV write, attention) is a callable of
the model's Kernels bundle (cadenza.kernels.ops), also bound once when the model is prepared
and passed down to the layers, so the layers never ask which backend runs.
"""

from __future__ import annotations

import torch
from torch import nn

from cadenza.kernels import ops
from cadenza.kernels.attention.cpu import reads_cache
from cadenza.kernels.attention.metadata import AttentionMetadata
from cadenza.kernels.attention.windowed import windowed_attention_ref
from cadenza.kernels.cpu.decode_stack import DecodeLayer, DecodeStackKernel, DecodeStackShape, bind_decode_stack
from cadenza.kernels.linear import choose_linear_method
from cadenza.kernels.linear.packed import PackedLinear
from cadenza.kernels.ops import Kernels
from cadenza.kernels.quant.weight import PackedWeight
from cadenza.models.config import ModelConfig
from cadenza.models.embedding import PackedEmbedding
from cadenza.models.linear import Linear
from cadenza.models.moe import SparseMoE
from cadenza.models.packing import pack_linear, pack_weight, packs_embedding
from cadenza.models.rope import cos_sin_cache, local_cos_sin_cache
from cadenza.models.tp import SINGLE, TPGroup
from cadenza.weight_format import WeightFormat

KVCache = tuple[torch.Tensor, torch.Tensor]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> gelu_tanh(gate) * up (Gemma's GeGLU)."""
    gate, up = x.chunk(2, dim=-1)
    return nn.functional.gelu(gate, approximate="tanh") * up


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.attention_scale
        sliding = index in cfg.sliding_layers
        self.window = cfg.sliding_window if sliding else None
        self.softcap = cfg.attn_softcap
        self.local_rope = sliding and cfg.local_rope_theta is not None  # reads the model's local cos/sin
        self.bf16_products = False  # prefill attention as the GEMMs: set by prepare_kernels from gemm_dtype
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.eps = cfg.rms_norm_eps
        # Qwen3: one RMSNorm weight over head_dim, shared by every query (key) head.
        self.q_norm = nn.Parameter(torch.ones(cfg.head_dim)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(cfg.head_dim)) if cfg.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos_sin: torch.Tensor, kv: KVCache, meta: AttentionMetadata, kernels: Kernels
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = kernels.rms_norm(q.reshape(-1, self.head_dim), self.q_norm, self.eps).view_as(q)
            k = kernels.rms_norm(k.reshape(-1, self.head_dim), self.k_norm, self.eps).view_as(k)
        q, k = kernels.rotary(q, k, cos_sin)
        kernels.write_kv(k, v, kv[0], kv[1], meta.slot_mapping)
        if self.softcap is None and (self.window is None or max(meta.seq_lens) <= self.window):
            out = kernels.paged_attention(q, kv[0], kv[1], meta, self.scale, self.bf16_products)
        else:  # a window that bites, or soft-capped scores: the torch path has both
            out = windowed_attention_ref(q, kv[0], kv[1], meta, self.scale, self.window, self.softcap)
        return self.o_proj(out.reshape(tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gelu = cfg.hidden_act == "gelu_tanh"  # Gemma's gate; every backend runs it in torch

    def forward(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        return self.down_proj(gelu_tanh_and_mul(gate_up) if self.gelu else kernels.silu_and_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.self_attn = Attention(cfg, index)
        self.mlp: MLP | SparseMoE = SparseMoE(cfg) if cfg.is_moe_layer(index) else MLP(cfg)
        self.input_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))

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
        h = self.self_attn(h, cos_sin, kv, meta, kernels)
        h, residual = kernels.fused_add_rms_norm(h, residual, self.post_attention_layernorm, self.eps)
        return self.mlp(h, kernels), residual

    def decode_layer(self) -> DecodeLayer:
        """This layer's weights by role, for the C decode stack (after prepare_kernels)."""
        attn, mlp = self.self_attn, self.mlp
        return DecodeLayer(
            input_norm=self.input_layernorm,
            post_attention_norm=self.post_attention_layernorm,
            qkv=attn.qkv_proj.method,
            qkv_bias=attn.qkv_proj.bias,
            o=attn.o_proj.method,
            o_bias=attn.o_proj.bias,
            gate_up=mlp.gate_up_proj.method,
            down=mlp.down_proj.method,
        )


class LlamaForCausalLM(nn.Module):
    """The whole model, or after cadenza.models.shard one rank's part: a pipeline stage
    (a run of layers) and a tensor-parallel slice of each. Families whose layers differ
    subclass it with their own decoder_layer (models/gemma.py; models/families.py maps
    architectures to classes)."""

    decoder_layer: type[nn.Module] = DecoderLayer

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        # Given storage, so no random init runs: on the meta device that init alone imports
        # torch._refs, seconds of every worker's start-up.
        embed = torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=embed)
        self.layers = nn.ModuleList(self.decoder_layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        # Tied models get their own copy, so its method may re-lay it out (see kernels/linear).
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Computed on the CPU even when built on the meta device: arange there goes through
        # torch's decompositions, which import torch._dynamo and with it Triton (~1 s of start-up
        # and ~100 MB resident in every engine process, for a cache build_model replaces anyway).
        with torch.device("cpu"):
            self.register_buffer("cos_sin", cos_sin_cache(cfg, max_positions), persistent=False)
            # Gemma 3's sliding layers turn at their own base (None for every other family).
            self.register_buffer("cos_sin_local", local_cos_sin_cache(cfg, max_positions), persistent=False)
        self.is_first_stage = self.is_last_stage = True
        self.tp: TPGroup = SINGLE
        self.vocab_start = 0  # this rank's first vocab row (vocab-parallel embedding)
        # Every op's implementation for this model's device, chosen once (bind_kernels).
        self.kernels: Kernels | None = None
        # All of this stage's layers in one C call for one-token steps on the CPU (prepare_kernels,
        # under the `cpu` backend only).
        self.decode_stack: DecodeStackKernel | None = None
        # How the weights are kept (set by the loader) and, when the file stores the embedding
        # packed, that table until prepare_kernels builds its lookup.
        self.weight_format = WeightFormat()
        self.weights_label = "float32"
        self.packed_embedding: PackedWeight | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] for a flattened batch of T tokens (single stage)."""
        x, residual = self.run_layers(self.embed(input_ids), None, positions, kv_caches, meta)
        return self.final_norm(x, residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The rows of input_ids, times the family's embed_scale (Gemma's sqrt(hidden))."""
        if self.tp.size == 1:
            x = self.embed_tokens(input_ids)
        else:
            local = input_ids - self.vocab_start
            outside = (local < 0) | (local >= self.embed_tokens.num_embeddings)
            x = self.embed_tokens(local.clamp(0, self.embed_tokens.num_embeddings - 1))
            x[outside] = 0
            x = self.tp.all_reduce(x)
        scale = self.cfg.embed_scale
        return x if scale == 1.0 else x * torch.tensor(scale, dtype=x.dtype)

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
        # reads_cache: the cache's dtype (kv_cache_dtype), a guard on the data, not the backend;
        # a sliding window the stack does not apply changes nothing while the context fits it.
        if self.decode_stack is not None and x.shape[0] == 1 and reads_cache(kv_caches[0][0]):
            slot, seq_len = int(meta.slot_mapping[0]), meta.seq_lens[0]
            if self.cfg.sliding_window is None or seq_len <= self.cfg.sliding_window:
                return self.decode_stack(x, residual, cos_sin, kv_caches, slot, meta.block_tables[0], seq_len)
        kernels = self._kernels()
        local = self.cos_sin_local[positions] if self.cos_sin_local is not None else cos_sin
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            rope = local if layer.self_attn.local_rope else cos_sin
            x, residual = layer(x, residual, rope, kv, meta, kernels)
        return x, residual

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        x, _ = self._kernels().fused_add_rms_norm(x, residual, self.norm, self.cfg.rms_norm_eps)
        return x

    def bind_kernels(self) -> Kernels:
        """Choose every op's implementation for this model's device, once: CADENZA_KERNELS is
        read here (and by the LinearMethods prepare_kernels builds), never per op."""
        self.kernels = ops.bind_kernels(self.norm.device)
        return self.kernels

    def _kernels(self) -> Kernels:
        # An unprepared model (the CUDA memory profile's step runs before prepare_kernels)
        # binds on its first step; from then on this is an attribute read.
        return self.kernels if self.kernels is not None else self.bind_kernels()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, vocab] fp32; under TP each rank's vocab slice is gathered (every rank must call).
        Gemma 2 soft-caps them: tanh(logits / cap) * cap."""
        logits = self.tp.all_gather_last(self.lm_head(hidden).float())[:, : self.cfg.vocab_size]
        cap = self.cfg.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def prepare_kernels(self) -> None:
        """Once loaded and sharded: each projection's storage in the weight format and its
        LinearMethod, the embedding's storage, and on the CPU (TP 1) the C decode stack:
        one-token steps then run all layers in csrc/decode_layer.c, the same math as
        DecoderLayer.forward with ~60 fewer torch calls a layer. The ops' bundle is bound here
        too, with the methods, so both follow the backend in force at this one moment."""
        kernels = self.bind_kernels()
        fmt = self.weight_format
        for module in self.modules():
            if isinstance(module, Linear):
                pack_linear(module, fmt, is_head=module is self.lm_head)
                module.method = choose_linear_method(
                    module.packed or module.weight_t, fmt.int8_activations, fmt.gemm_dtype
                )
            elif isinstance(module, Attention):
                module.bf16_products = fmt.gemm_dtype == torch.bfloat16
        for module in self.modules():  # after the projections: experts run on their methods
            if isinstance(module, SparseMoE):
                module.prepare(kernels, fmt.gemm_dtype)
        self._prepare_embedding()
        self.decode_stack = None
        # The C stack has no all-reduce: tensor-parallel layers run op by op; other backends too,
        # and layers the stack does not compute (q/k norms, experts, Gemma's: ModelConfig.plain_layers).
        if self.tp.size == 1 and kernels.backend == "cpu" and self.cfg.plain_layers:
            cfg = self.cfg
            shape = DecodeStackShape(
                hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                eps=cfg.rms_norm_eps, scale=cfg.head_dim**-0.5,
            )  # fmt: skip
            self.decode_stack = bind_decode_stack([layer.decode_layer() for layer in self.layers], shape)

    def _prepare_embedding(self) -> None:
        """The embedding reads the LM head's storage when they are tied (one copy), else its own
        packed table (a GGUF's, or packed as the format says); fp32 stays an nn.Embedding."""
        head = self.lm_head.method
        if self.cfg.tie_word_embeddings and self.is_first_stage and self.is_last_stage and self.tp.size == 1:
            if head is not None and head.packed() is not None:
                self.embed_tokens = PackedEmbedding(head.packed(), head.gather_rows)
            elif head is not None and head.fp32_rows() is not None:
                self.embed_tokens.weight = nn.Parameter(head.fp32_rows(), requires_grad=False)
            self.packed_embedding = None
            return
        table = self.packed_embedding
        if table is None and self.is_first_stage and packs_embedding(self.weight_format, self.embed_tokens.weight):
            table = pack_weight(self.embed_tokens.weight.detach(), self.weight_format, is_head=True)
        if table is not None:
            self.embed_tokens = PackedEmbedding(table, PackedLinear(table).gather_rows)
        self.packed_embedding = None

    def weight_bytes(self) -> int:
        """Bytes of distinct weights (a tied lm_head counted once): what a decode step streams.
        Projections count what their methods store, whatever the format."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        dense = {id(linear.weight_t) for linear in linears}
        params = {id(p): p for p in self.parameters() if id(p) not in dense}  # a shared table counts once
        total = sum(p.numel() * p.element_size() for p in params.values())
        total += sum(linear.weight_bytes() for linear in linears)
        if isinstance(self.embed_tokens, PackedEmbedding):
            total += self.embed_tokens.weight_bytes()
        return total - (self.lm_head.weight_bytes() if self.cfg.tie_word_embeddings else 0)
