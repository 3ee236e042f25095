"""Device selection: `device` auto|cuda|cpu (cadenza.device), and the kernel backend that
follows the tensors' device rather than the machine's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cadenza.config import EngineConfig
from cadenza.device import resolve_device, visible_gpus
from cadenza.format_names import resolve_int8_activations
from cadenza.kernels import backend as kernels_backend
from cadenza.weight_format import WeightFormat, resolve_dtype


def test_auto_takes_a_gpu_when_there_is_one_else_the_cpu() -> None:
    assert resolve_device("auto", 0) == "cpu"
    assert resolve_device("auto", 2) == "cuda"
    assert resolve_device("cpu", 4) == "cpu"
    assert resolve_device("cuda", 1) == "cuda"
    assert resolve_device("cuda:1", 2) == "cuda:1"


@pytest.mark.parametrize("name", ["gpu", "cuda:", "cuda:x", "cpu:0", "CUDA", "mps"])
def test_unknown_device_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="device must be one of auto, cuda, cpu"):
        EngineConfig(model="m", device=name)


def test_cuda_without_a_gpu_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"device='cuda' but the Ray cluster has no CUDA device.*--device cpu"):
        resolve_device("cuda", 0, "the Ray cluster")
    with pytest.raises(ValueError, match=r"device='cuda:2' but this process has 2 CUDA device\(s\)"):
        resolve_device("cuda:2", 2)


def test_placed_resolves_the_config_and_its_dtype() -> None:
    config = EngineConfig(model="m")
    assert config.device == "auto"
    assert config.placed(0).device == "cpu"
    on_gpu = config.placed(1)
    assert on_gpu.device == "cuda" and on_gpu.weight_format.compute_dtype == torch.bfloat16  # bf16 on CUDA
    assert on_gpu.compiled_graph and on_gpu.worker_resources()[1] == 1.0  # one GPU per worker


def test_the_backend_follows_the_tensors_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU host a model placed on the CPU still gets the CPU kernels, and CUDA tensors Triton's."""
    monkeypatch.delenv("CADENZA_KERNELS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert kernels_backend.backend(torch.device("cpu")) == kernels_backend.host_backend()
    assert kernels_backend.backend(torch.device("cuda", 0)) == "triton"
    assert kernels_backend.backend() == "triton"  # no tensor: where torch would put one
    monkeypatch.setenv("CADENZA_KERNELS", "torch")  # an explicit choice wins everywhere
    assert kernels_backend.backend(torch.device("cuda", 0)) == "torch"


@pytest.mark.skipif(visible_gpus() > 0, reason="checks the error where there is no GPU")
def test_the_cli_refuses_cuda_without_a_gpu_in_one_line() -> None:
    cli = str(Path(sys.executable).parent / "cadenza")
    out = subprocess.run([cli, "generate", "--device", "cuda", "hi"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert out.stderr.strip().startswith("cadenza: error: device='cuda' but this process has no CUDA device")


def test_cpu_auto_dtype_follows_the_cpu_unless_the_environment_says(monkeypatch: pytest.MonkeyPatch) -> None:
    bf16_cpu, plain_cpu = frozenset({"avx512_bf16", "fma"}), frozenset({"avx2", "fma"})
    assert resolve_dtype("auto", "cpu", bf16_cpu) == "bfloat16" and resolve_dtype("auto", "cpu", plain_cpu) == "float32"
    assert resolve_dtype("auto", "cuda", plain_cpu) == "bfloat16" and resolve_dtype("float16", "cpu") == "float16"
    monkeypatch.setenv("CADENZA_CPU_AUTO_DTYPE", "bfloat16")
    assert resolve_dtype("auto", "cpu") == "bfloat16" and resolve_dtype("auto", "cuda") == "bfloat16"
    monkeypatch.setenv("CADENZA_CPU_AUTO_DTYPE", "fp8")
    with pytest.raises(ValueError, match="CADENZA_CPU_AUTO_DTYPE='fp8'"):
        resolve_dtype("auto", "cpu")


def test_int8_activations_by_default_only_on_vnni_cpus_with_quantized_weights_and_auto_dtype(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unset int8_activations: on where the CPU has VNNI but no AMX, the weights stay
    quantized and dtype was left "auto"; an explicit value always wins; the environment pins
    the CPU's answer."""
    vnni, avx512_vnni, plain = frozenset({"avx2", "avx_vnni"}), frozenset({"avx512_vnni"}), frozenset({"avx2"})
    assert resolve_int8_activations(None, "auto", None, "cpu", vnni)
    assert resolve_int8_activations(None, "auto", None, "cpu", avx512_vnni | {"avx512_bf16"})  # Zen 4: faster
    assert not resolve_int8_activations(None, "auto", None, "cpu", avx512_vnni | {"avx512_bf16", "amx_bf16"})
    assert not resolve_int8_activations(None, "auto", None, "cpu", avx512_vnni | {"amx_tile"})  # AMX GEMMs
    assert resolve_int8_activations(None, "auto", "gguf", "cpu", avx512_vnni)
    assert not resolve_int8_activations(None, "auto", None, "cpu", plain)
    assert not resolve_int8_activations(None, "float32", None, "cpu", vnni)  # exact math asked for
    assert not resolve_int8_activations(None, "auto", "none", "cpu", vnni)  # dense weights
    assert not resolve_int8_activations(None, "auto", None, "cuda", vnni)
    assert resolve_int8_activations(True, "float32", None, "cpu", plain)
    assert not resolve_int8_activations(False, "auto", None, "cpu", vnni)
    monkeypatch.setenv("CADENZA_CPU_AUTO_INT8_ACTIVATIONS", "1")
    assert WeightFormat.resolve("auto", None, 32, "cpu").int8_activations
    assert not WeightFormat.resolve("auto", None, 32, "cpu", int8_activations=False).int8_activations
    assert WeightFormat.resolve("auto", None, 32, "cpu").describe().endswith("-a8")
    monkeypatch.setenv("CADENZA_CPU_AUTO_INT8_ACTIVATIONS", "0")  # the suite's own setting
    assert not WeightFormat.resolve("auto", None, 32, "cpu").int8_activations
    monkeypatch.setenv("CADENZA_CPU_AUTO_INT8_ACTIVATIONS", "yes")
    with pytest.raises(ValueError, match="choose 0 or 1"):
        WeightFormat.resolve("auto", None, 32, "cpu")


def test_cpu_gemms_are_bf16_only_where_auto_means_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """cpu_gemm_dtype "auto" follows what dtype "auto" means on this CPU and the dtype asked
    for: an explicit float32 keeps every GEMM fp32; CUDA's are the activations' dtype."""
    monkeypatch.setenv("CADENZA_CPU_AUTO_DTYPE", "bfloat16")  # as on an AVX512-BF16 / AMX CPU
    gemm = lambda dtype, device="cpu", asked="auto": (
        WeightFormat.resolve(  # noqa: E731
            dtype, None, 32, device, cpu_gemm_dtype=asked
        ).gemm_dtype
    )
    assert gemm("auto") == torch.bfloat16 and gemm("bfloat16") == torch.bfloat16
    assert gemm("float32") == torch.float32 and gemm("float16") == torch.float32
    assert gemm("auto", asked="float32") == torch.float32
    monkeypatch.setenv("CADENZA_CPU_AUTO_DTYPE", "float32")  # a CPU without native bf16
    assert gemm("auto") == torch.float32 and gemm("bfloat16") == torch.float32
    assert gemm("float32", asked="bfloat16") == torch.bfloat16  # asked for: slow, but honoured
    assert gemm("float16", device="cuda") == torch.float16
    with pytest.raises(ValueError, match="cpu_gemm_dtype must be one of"):
        EngineConfig(model="m", cpu_gemm_dtype="int8")


def test_the_kv_cache_is_fp16_by_default_only_where_the_cpu_gemms_are_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """kv_cache_dtype "auto" follows cpu_gemm_dtype on the CPU: fp16 K/V where prefill already
    rounds to bf16, the exact fp32 elsewhere (an explicit float32 GEMM keeps fp32 KV); CUDA's
    is the activations' dtype; an explicit kv_cache_dtype wins."""
    kv = lambda dtype, device="cpu", gemm="auto", asked="auto": (  # noqa: E731
        WeightFormat.resolve(dtype, None, 32, device, kv_cache_dtype=asked, cpu_gemm_dtype=gemm).cache_dtype(
            torch.float32
        )
    )
    monkeypatch.setenv("CADENZA_CPU_AUTO_DTYPE", "bfloat16")  # as on an AVX512-BF16 / AMX CPU
    assert kv("auto") == torch.float16
    assert kv("auto", gemm="float32") == torch.float32 and kv("float32") == torch.float32
    assert kv("auto", asked="float32") == torch.float32
    monkeypatch.setenv("CADENZA_CPU_AUTO_DTYPE", "float32")  # a CPU without native bf16
    assert kv("auto") == torch.float32
    assert kv("float32", gemm="bfloat16") == torch.float16  # bf16 GEMMs asked for
    assert kv("bfloat16", device="cuda") == torch.bfloat16
