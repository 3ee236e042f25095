"""PackedWeight: one projection's weight [rows = out features, cols = in features] in a
format the kernels read directly, never expanded to fp32 in memory.

Kinds and their tensors (all row-major, one row per output feature):
- "f32" / "bf16" / "f16": `data` [rows, cols] in that dtype.
- "q8": `data` int8 [rows, cols], `scales` fp32 [rows, cols / group]; w = q * scale.
  group = cols for on-load int8 (one scale per output channel), 32 for GGUF Q8_0.
- "q4": `data` uint8 [rows, cols / 2], `scales` and `mins` fp16 [rows, cols / group];
  w = q * scale + min, q in 0..15; without mins (GGUF Q4_0) w = (q - 8) * scale.
  Codes come in sub-blocks of 32 elements, 16 bytes each: element j of a sub-block is the
  low nibble of its byte j and element j + 16 the high nibble (GGUF's Q4_0 / Q4_1 order, so
  those files are a split of their blocks, and on-load int4 shares the kernels).
  group (elements per scale) is 32, 64 or 128: on-load int4's setting, 32 for GGUF.
- "q4_k" / "q6_k": `data` uint8 [rows, cols / 256 * block bytes], GGUF's own super-blocks
  (144 / 210 bytes per 256 weights); their two-level scales are decoded in the kernel, which
  keeps them at 4.5 / 6.56 bits a weight.
Scales of q8 are fp32 because per-channel int8 scales of small rows fall below fp16's normal
range; q4's are fp16, at 4 bytes per group the difference between 0.56 and 0.62 B a weight.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

SUBBLOCK = 32  # q4 codes are laid out in sub-blocks of this many elements
SUPERBLOCK = 256  # q4_k / q6_k super-block
SUPERBLOCK_BYTES = {"q4_k": 144, "q6_k": 210}
DENSE_KINDS = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
KINDS = (*DENSE_KINDS, "q8", "q4", "q4_k", "q6_k")
# The integer each kind has in csrc/cadenza_kernels.h (enum weight_kind).
KIND_CODES = {kind: code for code, kind in enumerate(KINDS)}
# The kinds kernels/quant/triton_gemm.py reads on CUDA (here, so choosing a method needs no Triton).
TRITON_KINDS = ("q8", "q4")


@dataclass(frozen=True)
class PackedWeight:
    kind: str
    rows: int
    cols: int
    data: torch.Tensor
    group: int = 0
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown weight kind {self.kind!r}; known: {KINDS}")

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.data, self.scales, self.mins) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device: torch.device | str) -> PackedWeight:
        moved = {name: getattr(self, name) for name in ("data", "scales", "mins")}
        return replace(self, **{n: t if t is None else t.to(device) for n, t in moved.items()})

    def select_rows(self, ranges: list[tuple[int, int]]) -> PackedWeight:
        """The given [start, end) output rows, concatenated (column-parallel slices, fused parts)."""

        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else torch.cat([t[s:e] for s, e in ranges]).contiguous()

        rows = sum(e - s for s, e in ranges)
        return replace(self, rows=rows, data=take(self.data), scales=take(self.scales), mins=take(self.mins))

    def row_view(self, start: int, end: int) -> PackedWeight:
        """Output rows [start, end) as views of this storage (contiguous: rows are the outer dim)."""

        def view(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[start:end]

        return replace(self, rows=end - start, data=view(self.data), scales=view(self.scales), mins=view(self.mins))

    def take_rows(self, index: torch.Tensor) -> PackedWeight:
        """Rows `index` in that order (llama.cpp's Q/K row permutation undone, lookups)."""

        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index].contiguous()

        return replace(self, rows=len(index), data=take(self.data), scales=take(self.scales), mins=take(self.mins))

    def narrow_cols(self, start: int, end: int) -> PackedWeight:
        """Input features [start, end) (row-parallel slices); must fall on group boundaries."""
        unit = self.column_unit()
        if start % unit or end % unit:
            raise ValueError(f"a {self.kind} weight splits only at multiples of {unit} input features")
        per = self.data.shape[1] / self.cols  # storage columns per input feature
        data = self.data[:, int(start * per) : int(end * per)].contiguous()

        per_channel = self.group == self.cols  # one scale a row: it stays whole

        def groups(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or per_channel:
                return t
            return t[:, start // self.group : end // self.group].contiguous()

        group = end - start if per_channel else self.group
        return replace(
            self, cols=end - start, data=data, group=group, scales=groups(self.scales), mins=groups(self.mins)
        )

    @property
    def can_round_activations(self) -> bool:
        """Whether the int8_activations kernels apply (q4 / q8 in blocks of 32: see
        csrc/packed_linear.c); other kinds always multiply x as it is."""
        return self.kind in ("q4", "q8") and self.cols % SUBBLOCK == 0

    def gguf_label(self) -> str:
        """The GGUF type this storage holds ("q4_1", "q8_0", "q6_k", "bf16", ...)."""
        if self.kind == "q8":
            return "q8_0"
        if self.kind == "q4":
            return "q4_1" if self.mins is not None else "q4_0"
        return self.kind

    def column_unit(self) -> int:
        """The input-feature granularity this weight can be cut at."""
        if self.kind in SUPERBLOCK_BYTES:
            return SUPERBLOCK
        if self.kind == "q8" and self.group == self.cols:
            return 1
        return self.group or 1


def cat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """Weights of the same kind and columns stacked by rows (q|k|v, gate|up fused)."""
    first = parts[0]
    if any((p.kind, p.cols, p.group) != (first.kind, first.cols, first.group) for p in parts):
        raise ValueError("only weights of one kind, width and group stack")

    def stack(name: str) -> torch.Tensor | None:
        tensors = [getattr(p, name) for p in parts]
        return None if tensors[0] is None else torch.cat(tensors).contiguous()

    rows = sum(p.rows for p in parts)
    return replace(first, rows=rows, data=stack("data"), scales=stack("scales"), mins=stack("mins"))


def ideal_bytes_per_weight(weight: PackedWeight) -> float:
    """What the format costs per weight at its nominal size (codes plus scales), the yardstick
    the resident bytes are held to."""
    if weight.kind in DENSE_KINDS:
        return torch.empty(0, dtype=DENSE_KINDS[weight.kind]).element_size()
    if weight.kind in SUPERBLOCK_BYTES:
        return SUPERBLOCK_BYTES[weight.kind] / SUPERBLOCK
    if weight.kind == "q8":
        return 1 + 2 / weight.group  # an fp16 scale per group, as GGUF's Q8_0
    return 0.5 + (4 if weight.mins is not None else 2) / weight.group
