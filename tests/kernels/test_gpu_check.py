"""The GPU check's own logic, on tiny shapes: under the Triton interpreter here, on CUDA there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cadenza_testkit.kernel_compare import DEVICE

from cadenza.benchmarks import gpu_cases, gpu_check

KERNELS = {
    "fused_add_rms_norm",
    "rotary",
    "silu_and_mul",
    "write_kv",
    "decode_attention",
    "prefill_attention",
    "extend_attention",
    "w8a16_matmul",
    "w4a16_matmul",
    "gguf_matmul",
    "fused_moe",
    "kv_handoff",  # not a kernel: the KV connector's hand-over of blocks, on the device's caches
    "kv_pull",  # nor this: the ipc transport's copy out of another process's shared cache
    "kv_nixl",  # nor this: the nixl transport's read out of another process's registered cache
}


def test_tiny_run_checks_every_kernel(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main(["--device", DEVICE, "--tiny", "--quick"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["num_failed"] == report["num_skipped"] == 0
    assert {r["kernel"] for r in report["results"]} == KERNELS
    for result in report["results"]:
        # Timings are reported, never judged: the interpreter's are meaningless and vary.
        assert result["passed"] and result["ms"] >= 0 and result["speedup"] >= 0
    model = report["model"]  # the whole engine against transformers, same random weights
    assert model["passed"] and model["vs_transformers"]["greedy_identical"], model
    eager = model["eager"]  # the CPU has no graphs: only the eager engine runs
    assert "graphs" not in model and eager["graph_replays"] is None
    assert eager["vs_transformers"]["steps"] == 64 and eager["vs_transformers"]["max_logprob_diff"] < 1e-3
    assert set(eager["tpot_ms"]) == {"1", "8", "64"} and all(v > 0 for v in eager["tpot_ms"].values())
    assert eager["decode_step_bytes"] > 0 and eager["copy_bandwidth_gb_s"] > 0 and eager["kv_pool_blocks"] == 520
    ahead = model["eager_async"]  # the same engine scheduling one step ahead: the same tokens, timed too
    assert ahead["vs_transformers"]["greedy_identical"] and ahead["vs_transformers"]["steps"] == 64
    assert set(model["async_speedup"]) == {"1", "8", "64"} and all(v > 0 for v in model["async_speedup"].values())


@pytest.mark.parametrize("type_name", gpu_cases.GGUF_TYPES)
def test_random_gguf_blocks_are_what_gguf_reads(type_name: str) -> None:
    """The fallback for a gguf that cannot quantize: blocks gguf itself decodes as the split does."""
    import gguf
    import numpy as np

    from cadenza.kernels.quant.dequantize import dequantize
    from cadenza.kernels.quant.gguf_blocks import packed_from_gguf

    raw = gpu_cases.random_gguf_blocks(type_name, 4, 64)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).astype(np.float32)
    got = dequantize(packed_from_gguf(type_name, raw, 4, 64))
    torch.testing.assert_close(got, torch.from_numpy(expected), rtol=0, atol=0)
    assert 0 < got.abs().max() < 0.5


def test_a_failing_case_is_reported_not_raised() -> None:
    def broken() -> torch.Tensor:
        raise RuntimeError("no kernel image")

    def cases(*_: object) -> object:
        yield gpu_check.Case("k", {}, broken, broken, broken, broken)

    results = gpu_check._run_family(cases(), "family", torch.float16, torch.device("cpu"), float("inf"), True)
    assert results == [
        {"kernel": "family", "dtype": "float16", "passed": False, "error": "RuntimeError('no kernel image')"}
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for machines without CUDA")
def test_without_cuda_it_says_so_and_exits_nonzero() -> None:
    """Through the `cadenza` command, as `make gpu-check` runs it."""
    cadenza = str(Path(sys.executable).with_name("cadenza"))
    proc = subprocess.run([cadenza, "gpu-check", "--quick"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "CUDA is not available" in proc.stderr and "Traceback" not in proc.stderr
