"""Our GGUF container reader (cadenza/models/gguf_file.py) against gguf-py's reader: the same
metadata values and the same tensor views, on SmolLM2 and on a file holding every value type;
and a clear ValueError, never a hang or a read past the end, on a corrupt file."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cadenza.models.gguf_file import GGUFFile, read_gguf_file
from cadenza.models.gguf_reader import open_gguf

Q = gguf.GGMLQuantizationType


def _assert_same_as_gguf_py(path: Path) -> GGUFFile:
    ours, theirs = read_gguf_file(path), gguf.GGUFReader(str(path))
    # gguf-py adds its header counts as GGUF.* pseudo-fields
    their_fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(their_fields)
    for key, value in their_fields.items():
        assert ours.fields[key] == value, key
        assert type(ours.fields[key]) is type(value), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.tensor_type, a.shape) == (b.tensor_type, tuple(b.shape.tolist())), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name
    return ours


@pytest.mark.heavy  # not in make test-quick: the real model, and gguf-py parses it in 2.5 s
def test_smollm2_reads_as_gguf_py_reads_it(smollm_path: Path) -> None:
    ours = _assert_same_as_gguf_py(smollm_path)
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152 and len(ours.tensors) == 272


def _every_type_file(path: Path) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.25)
    writer.add_bool("t.bool", True)
    writer.add_uint64("t.u64", 2**63 + 7)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.floats", [0.5, -1.5])
    writer.add_array("t.strs", ["a", "", "ü"])
    writer.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("plain", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("half", rng.standard_normal((2, 64)).astype(np.float16))
    blocks = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), Q.Q8_0)
    writer.add_tensor("q8", blocks, raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_value_type_and_tensor_kind_reads_as_gguf_py_reads_it(tmp_path: Path) -> None:
    ours = _assert_same_as_gguf_py(_every_type_file(tmp_path / "all.gguf"))
    assert ours.fields["t.strs"] == ["a", "", "ü"] and ours.fields["t.u64"] == 2**63 + 7
    assert ours.tensors[2].data.shape == (4, 68)  # 2 Q8_0 blocks of 34 bytes per row


def test_a_huge_count_fails_at_once(tmp_path: Path) -> None:
    path = _every_type_file(tmp_path / "all.gguf")
    data = bytearray(path.read_bytes())
    data[16:24] = (2**62).to_bytes(8, "little")  # the key-value count
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="truncated"):
        read_gguf_file(path)


@pytest.mark.parametrize("body", [b"", b"GGU", b"GGML" + bytes(20), b"GGUF" + (1).to_bytes(4, "little") + bytes(16)])
def test_not_a_gguf_is_a_value_error_naming_the_file(tmp_path: Path, body: bytes) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(body)
    with pytest.raises(ValueError, match=r"bad\.gguf: not a valid GGUF file"):
        open_gguf(path)


@settings(max_examples=60, deadline=None)
@given(cut=st.floats(0, 1), flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), max_size=4))
def test_a_cut_or_corrupted_file_is_a_value_error_or_reads(tmp_path_factory, cut: float, flips: list) -> None:
    """Any prefix of a valid file, with some bytes overwritten, either reads (its tensors inside
    the file) or raises ValueError: nothing else, and no read past the end."""
    good = _every_type_file(tmp_path_factory.mktemp("g") / "all.gguf").read_bytes()
    data = bytearray(good[: int(cut * len(good))])
    for where, value in flips:
        if data:
            data[int(where * (len(data) - 1))] = value
    path = tmp_path_factory.mktemp("c") / "cut.gguf"
    path.write_bytes(bytes(data))
    try:
        parsed = open_gguf(path)
    except ValueError:
        return
    assert all(t.data.nbytes <= len(data) for t in parsed.tensors)
