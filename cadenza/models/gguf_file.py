"""A GGUF file's metadata as plain Python values and its tensors as views of the mapped file.

gguf-py's reader builds several numpy views per metadata value; SmolLM2's ~100k vocabulary and
merge strings made one parse take 2.4 s, and a model load parsed the file two or three times
(config, tokenizer, weights). Reading each value once with `struct` straight off the map takes
about 0.1 s for the same file. gguf-py stays the source of the quantization types, their
block sizes and the dequantizers; only the container is read here.

The format: a header (magic, version, tensor and key-value counts), the key-value pairs, the
tensor index (name, dims, type, offset), then the tensor data from the next multiple of
`general.alignment`. Every count is checked against the bytes left, so a corrupt file fails
fast instead of looping or reading past its end."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# value type -> (struct format, numpy dtype) for the fixed-size scalars
_SCALARS: dict[int, tuple[str, type]] = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
# Tensor types stored as plain elements; every other type is blocks of bytes.
_ELEMENTS = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    """`shape` is in GGUF order (fastest dimension first); `data` is a read-only view of the
    map, elements for the plain types and [rows, bytes per row] for the block types."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    fields: dict[str, Any]
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.at = data, 0

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size)
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return value

    def need(self, size: int) -> None:
        if size < 0 or self.at + size > len(self.data):
            raise ValueError(f"truncated at byte {self.at} (needs {size} more)")

    def count(self, item_bytes: int) -> int:
        """A u64 count of items at least `item_bytes` long each, checked against the bytes left."""
        n = self.unpack("<Q")
        self.need(n * item_bytes)
        return n

    def string(self) -> str:
        size = self.unpack("<Q")
        self.need(size)
        text = self.data[self.at : self.at + size].decode("utf-8")
        self.at += size
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array(self.unpack("<I"))
        if kind not in _SCALARS:
            raise ValueError(f"unknown value type {kind} at byte {self.at}")
        return self.unpack(_SCALARS[kind][0])

    def array(self, kind: int) -> list[Any]:
        if kind in _SCALARS:  # numbers in one read
            dtype = np.dtype(_SCALARS[kind][1]).newbyteorder("<")
            n = self.count(dtype.itemsize)
            items = np.frombuffer(self.data, dtype, n, self.at).tolist()
            self.at += n * dtype.itemsize
            return items
        n = self.count(8 if kind == _STRING else 4)
        return [self.value(kind) for _ in range(n)]


def read_gguf_file(path: Path) -> GGUFFile:
    """Raises ValueError (with the byte it stopped at) on anything that is not a GGUF v2/v3 file."""
    with path.open("rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(data)
    cursor.need(4)
    if data[:4] != _MAGIC:
        raise ValueError("no GGUF magic")
    cursor.at = 4
    version = cursor.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (a big-endian file or an unsupported version); supported: 2, 3")
    tensor_count, field_count = cursor.unpack("<Q"), cursor.count(12)
    cursor.need(tensor_count * 24)
    fields: dict[str, Any] = {}
    for _ in range(field_count):
        key = cursor.string()
        fields[key] = cursor.value(cursor.unpack("<I"))
    index = [_tensor_entry(cursor) for _ in range(tensor_count)]
    alignment = fields.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    start = -(-cursor.at // alignment) * alignment
    return GGUFFile(fields, _tensors(data, start, index))


def _tensor_entry(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string()
    dims = cursor.unpack("<I")
    cursor.need(dims * 8)
    shape = tuple(cursor.unpack("<Q") for _ in range(dims))
    return name, shape, cursor.unpack("<I"), cursor.unpack("<Q")


def _tensors(data: mmap.mmap, start: int, index: list[tuple[str, tuple[int, ...], int, int]]) -> list[GGUFTensor]:
    tensors, seen = [], set()
    for name, shape, type_code, offset in index:
        if name in seen:
            raise ValueError(f"tensor {name} appears twice")
        seen.add(name)
        kind = GGMLQuantizationType(type_code)
        dims = tuple(reversed(shape))
        elements = int(np.prod(shape))
        if kind in _ELEMENTS:
            dtype, count = np.dtype(_ELEMENTS[kind]), elements
        else:
            block, size = GGML_QUANT_SIZES[kind]
            dtype, count, dims = np.dtype(np.uint8), elements // block * size, quant_shape_to_byte_shape(dims, kind)
        if start + offset + count * dtype.itemsize > len(data):
            raise ValueError(f"tensor {name} runs past the end of the file")
        view = np.frombuffer(data, dtype, count, start + offset).reshape(dims)
        tensors.append(GGUFTensor(name, kind, shape, view))
    return tensors
