"""How the C kernels are built and bound: the cache key, the header against the bindings'
table, and the checked keyword call."""

from __future__ import annotations

import ctypes
import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from cadenza.kernels.cpu import bindings, build
from cadenza.kernels.cpu.bindings import DecodeDim, DecodeWeight

HEADER = build.SOURCES / "cadenza_kernels.h"
C_TYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}


def _header_text() -> str:
    return re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.DOTALL)


def _c_type(declaration: str) -> type:
    return bindings.POINTER if "*" in declaration else C_TYPES[declaration.replace("const", "").split()[0]]


def _header_prototypes() -> dict[str, tuple[type | None, tuple[tuple[str, type], ...]]]:
    """name -> (return type, ((argument, ctypes type), ...)) for every declaration in the header."""
    prototypes = {}
    for restype, name, params in re.findall(r"^(\w+)\s+(\w+)\(([^)]*)\);", _header_text(), flags=re.MULTILINE):
        args = tuple((re.findall(r"\w+", p)[-1], _c_type(p)) for p in params.split(","))
        prototypes[name] = (None if restype == "void" else C_TYPES[restype], args)
    return prototypes


def test_the_bindings_name_and_type_every_argument_as_the_header_does() -> None:
    declared = _header_prototypes()
    assert set(declared) == {f.name for f in bindings.FUNCTIONS}
    for function in bindings.FUNCTIONS:
        assert (function.restype, function.args) == declared[function.name], function.name


def test_the_decode_enums_are_the_headers() -> None:
    enums = dict(re.findall(r"enum (\w+) \{([^}]*)\};", _header_text()))
    for python, c_name, count in (
        (DecodeWeight, "decode_weight", "NUM_WEIGHTS"),
        (DecodeDim, "decode_dim", "NUM_DIMS"),
    ):
        names = [n.strip() for n in enums[c_name].split(",")]
        assert names == [member.name for member in python] + [count]
        assert [member.value for member in python] == list(range(len(python)))  # C numbers them from 0


def test_a_call_must_name_every_argument_once() -> None:
    x, out = torch.zeros(1, 8), torch.empty(1, 4)
    with pytest.raises(TypeError, match=r"missing arguments \['num_threads'\], unexpected \[\]"):
        bindings.SILU_AND_MUL(x=x, out=out, rows=1, inter=4)
    with pytest.raises(TypeError, match=r"missing arguments \[\], unexpected \['threads'\]"):
        bindings.SILU_AND_MUL(x=x, out=out, rows=1, inter=4, num_threads=1, threads=1)
    if not bindings.SILU_AND_MUL.available():
        pytest.skip("no C compiler: the kernels cannot be built here")
    bindings.SILU_AND_MUL(x=x, out=out, rows=1, inter=4, num_threads=1)
    torch.testing.assert_close(out, torch.zeros(1, 4))


def test_the_cache_key_follows_the_compiler_the_flags_and_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    base = build.cache_key("cc")
    assert build.cache_key("cc") == base
    changes = {
        "compiler_version": lambda command: "cc (Another) 99.0.1",
        "cpu_identity": lambda: "model name: another CPU\nflags: fpu sse2",
        "CFLAGS": (*build.CFLAGS, "-mno-avx"),
    }
    keys = {base}
    for name, value in changes.items():
        with monkeypatch.context() as patch:
            patch.setattr(build, name, value)
            keys.add(build.cache_key("cc"))
    assert len(keys) == 1 + len(changes)
    assert build.cache_key("clang") != base


def test_the_cpu_identity_is_the_model_name_and_flags(tmp_path: Path) -> None:
    core = "processor\t: {n}\nmodel name\t: Some CPU @ 2.0GHz\nflags\t\t: fpu sse2 {extra}\ncpu MHz\t\t: {mhz}\n\n"
    info = tmp_path / "cpuinfo"
    info.write_text(core.format(n=0, extra="avx2", mhz=2000.1) + core.format(n=1, extra="avx2", mhz=1999.7))
    identity = build.cpu_identity(info)
    assert identity == "flags: fpu sse2 avx2\nmodel name: Some CPU @ 2.0GHz"  # the clock does not count
    info.write_text(core.format(n=0, extra="avx512f", mhz=2000.1))
    assert build.cpu_identity(info) != identity
    assert build.cpu_identity(tmp_path / "absent") == (platform.processor() or platform.machine())


def test_another_cpu_builds_its_own_library(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CADENZA_CACHE_DIR", str(tmp_path))
    build.load.cache_clear()
    try:
        if build.load("gemv") is None:
            pytest.skip("no C compiler: the kernels cannot be built here")
        monkeypatch.setattr(build, "cpu_identity", lambda: "model name: another CPU")
        build.load.cache_clear()
        assert build.load("gemv") is not None
        assert len(list(tmp_path.glob("gemv-*.so"))) == 2
    finally:
        monkeypatch.undo()
        build.load.cache_clear()


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which(build.compiler()) is None, reason="x86 with cc")
@pytest.mark.parametrize("arch", ["haswell", "icelake-server", "sapphirerapids", "alderlake"])
def test_every_x86_instruction_set_variant_compiles(tmp_path: Path, arch: str) -> None:
    """The kernels pick their paths from the target's instruction set at build time (AVX2 + FMA;
    AVX512-VNNI or AVX-VNNI for the int8 dot): each variant must build, even where this host
    cannot run it. Compile only."""
    flags = [f if f != "-march=native" else f"-march={arch}" for f in build.CFLAGS]
    source = build.SOURCES / "decode_layer.c"  # includes every other kernel source
    command = [build.compiler(), *flags, str(source), "-o", str(tmp_path / "k.so"), "-lm"]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
