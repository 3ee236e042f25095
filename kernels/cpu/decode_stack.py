"""A pipeline stage's decoder layers for one token in a single C call (csrc/decode_layer.c).

One-token steps on the CPU run the same math as the model's DecoderLayer.forward with ~60
fewer torch calls a layer and one ctypes call a step. The model names each layer's weights
by role (DecodeLayer); bind_decode_stack lays them out in the C kernel's order, where every
projection has a C binding (LinearMethod.c_weight: fp32 rows or any packed format).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from cadenza.kernels.cpu.bindings import DECODE_LAYER_SCRATCH, DECODE_LAYERS, DecodeDim, DecodeWeight, for_cache
from cadenza.kernels.cpu.gemv import gemv_available
from cadenza.kernels.cpu.packed import BoundWeight
from cadenza.kernels.linear.base import LinearMethod


@dataclass(frozen=True)
class DecodeLayer:
    """One decoder layer's weights by role: its norms, its four projections and their biases."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: LinearMethod
    qkv_bias: torch.Tensor | None
    o: LinearMethod
    o_bias: torch.Tensor | None
    gate_up: LinearMethod
    down: LinearMethod


@dataclass(frozen=True)
class DecodeStackShape:
    """What decode_layer.c needs beyond the weights (the intermediate size comes from them)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scale: float


def decode_layers_available() -> bool:
    return DECODE_LAYERS.available()


def bind_decode_stack(layers: list[DecodeLayer], shape: DecodeStackShape) -> DecodeStackKernel | None:
    """The stage's layers bound for the C kernel, or None where it cannot run them: a
    projection without a C binding (another device, stacked formats), or no build."""
    weights = [_in_kernel_order(layer) for layer in layers]
    if not weights or any(w is None for w in weights):
        return None
    # Checked after the weights, so a GPU or bf16 model never starts a C build.
    if not (gemv_available() and decode_layers_available()):
        return None
    dims = {
        DecodeDim.D_HIDDEN: shape.hidden,
        DecodeDim.D_HEADS: shape.heads,
        DecodeDim.D_KV_HEADS: shape.kv_heads,
        DecodeDim.D_HEAD_DIM: shape.head_dim,
        DecodeDim.D_INTER: weights[0][DecodeWeight.W_DOWN].weight.cols,
        DecodeDim.D_BLOCK_SIZE: 0,  # the KV cache's, known at the first call
    }
    return DecodeStackKernel(weights, dims, shape.eps, shape.scale)


Slot = torch.Tensor | BoundWeight | None


def _in_kernel_order(layer: DecodeLayer) -> list[Slot] | None:
    bound = [method.c_weight() for method in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    if any(b is None for b in bound):
        return None
    qkv, o, gate_up, down = bound
    by_slot = {
        DecodeWeight.W_LN1: layer.input_norm,
        DecodeWeight.W_LN2: layer.post_attention_norm,
        DecodeWeight.W_QKV: qkv,
        DecodeWeight.B_QKV: layer.qkv_bias,
        DecodeWeight.W_O: o,
        DecodeWeight.B_O: layer.o_bias,
        DecodeWeight.W_GATE_UP: gate_up,
        DecodeWeight.W_DOWN: down,
    }
    return [t.detach() if isinstance(t, torch.Tensor) else t for t in (by_slot[slot] for slot in DecodeWeight)]


def _address(slot: Slot) -> int | None:
    if slot is None:
        return None
    return slot.address if isinstance(slot, BoundWeight) else slot.data_ptr()


def _pointers(slots: list[Slot]) -> ctypes.Array:
    return (ctypes.c_void_p * len(slots))(*[_address(t) for t in slots])


class DecodeStackKernel:
    """A run of decoder layers' weights, bound for csrc/decode_layer.c (one token, fp32, TP 1).

    `layers[l]` holds layer l's weights in DecodeWeight order: the projections bound (any
    format), the norms and biases contiguous fp32 CPU. They are kept here, so the pointers
    stay valid as long as this object lives."""

    def __init__(self, layers: list[list[Slot]], dims: dict[DecodeDim, int], eps: float, scale: float) -> None:
        if not decode_layers_available():
            raise RuntimeError("the CPU decode-layer kernel is not built (see the log for why)")
        for t in (t for weights in layers for t in weights if isinstance(t, torch.Tensor)):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError("the decode-layer kernel takes contiguous fp32 CPU norms and biases")
        self.layers, self.eps, self.scale = layers, eps, scale
        self.pointers = _pointers([t for weights in layers for t in weights])
        self.dims = (ctypes.c_int64 * len(DecodeDim))(*[dims[d] for d in DecodeDim])
        self.scratch = torch.empty(DECODE_LAYER_SCRATCH(dims=self.dims), dtype=torch.float32)

    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        slot: int,
        block_table: torch.Tensor,
        seq_len: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(last mlp output, residual stream) for one token x [1, hidden], as the layers' forwards."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"{len(self.layers)} layers but {len(kv_caches)} KV caches")
        x, cos_sin, block_table = x.contiguous(), cos_sin.contiguous(), block_table.contiguous()
        residual = None if residual is None else residual.contiguous()
        out, res_out = torch.empty_like(x), torch.empty_like(x)
        self.dims[DecodeDim.D_BLOCK_SIZE] = kv_caches[0][0].shape[1]
        # The caches' pointer arrays hold addresses only: kv_caches itself keeps them alive.
        status = for_cache(DECODE_LAYERS, kv_caches[0][0].dtype)(
            w=self.pointers, n_layers=len(self.layers), dims=self.dims, eps=self.eps, scale=self.scale, x=x,
            res=residual, out=out, res_out=res_out, cos_sin=cos_sin, k_caches=_pointers([k for k, _ in kv_caches]),
            v_caches=_pointers([v for _, v in kv_caches]), slot=slot, block_table=block_table, seq_len=seq_len,
            scratch=self.scratch, num_threads=torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("the CPU decode-layer kernel could not allocate its attention scores")
        return out, res_out
