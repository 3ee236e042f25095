"""`cadenza bench formats` on a fake LLM factory: the measuring and the report, not the model."""

from __future__ import annotations

import json
import sys
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cadenza.benchmarks import formats
from cadenza.cli.main import main
from cadenza.models.config import ModelConfig
from cadenza.outputs import RequestMetrics

CFG = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=500, hidden_size=64, intermediate_size=96, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=2048,
    tie_word_embeddings=True,
)  # fmt: skip
# (dtype, quantization) -> decode tok/s, TTFT s, batch tok/s, bytes per weight: what the fake runs at.
SPEEDS = {
    ("float32", "none"): (50.0, 0.20, 400.0, 4.0),
    ("bfloat16", "none"): (80.0, 0.25, 500.0, 2.0),
    (None, "int8"): (100.0, 0.30, 600.0, 1.0625),
    (None, "gguf"): (150.0, 0.40, 800.0, 0.5625),
}
T0 = 1000.0


class FakeModel:
    def __init__(self, bytes_per_weight: float) -> None:
        self.bytes = round(bytes_per_weight * formats.count_weights(CFG))

    def weight_bytes(self) -> int:
        return self.bytes


class FakeLLM:
    """Answers generate() with metrics timed at the format's speeds; records what it was asked."""

    def __init__(self, speeds: tuple[float, float, float, float], calls: list) -> None:
        self.decode, self.ttft, self.batch, bpw = speeds
        self.engine = SimpleNamespace(model_config=CFG, runner=SimpleNamespace(model=FakeModel(bpw)))
        self.calls = calls

    def generate(self, prompts: Any, params: Any, use_tqdm: bool = True) -> list[SimpleNamespace]:
        prompts = [prompts] if isinstance(prompts, dict) else prompts
        ids = [p["prompt_token_ids"] for p in prompts]
        self.calls.append(([len(i) for i in ids], params))
        n = params.max_tokens
        if len(ids) > 1:  # the batch: every request ends when the whole batch does
            first, last = T0 + self.ttft, T0 + len(ids) * n / self.batch
        else:
            first = T0 + self.ttft
            last = first + (n - 1) / self.decode
        metrics = RequestMetrics(arrival_time=T0, first_token_time=first, last_token_time=last, finished_time=last)
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7] * n)], metrics=[metrics]) for _ in ids]


@pytest.fixture
def fake_bench(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """The bench with a fake LLM factory and a fixed machine: events say when each LLM was
    built and freed, calls what each was asked."""
    state = SimpleNamespace(events=[], calls=[], kwargs=[])

    def factory(model: str, **kwargs: Any) -> FakeLLM:
        state.kwargs.append(kwargs)
        key = (kwargs.get("dtype"), kwargs["quantization"])
        if key not in SPEEDS:
            raise ValueError(f"no such format here: {key}")
        alive = sum(1 if e[0] == "build" else -1 for e in state.events)
        assert alive == 0, "an LLM is built while the previous one is still alive"
        state.events.append(("build", key))
        llm = FakeLLM(SPEEDS[key], state.calls)
        weakref.finalize(llm, state.events.append, ("free", key))
        return llm

    monkeypatch.setattr(formats, "make_llm", factory)
    monkeypatch.setattr(formats, "measure_read_gbps", lambda: 10.0)
    monkeypatch.setattr(formats, "measure_gemm_gflops", lambda: 100.0)
    monkeypatch.setattr(formats, "gguf_stored_type", lambda model: "q4_1")
    return state


def _run(tmp_path: Path, capsys: pytest.CaptureFixture, *extra: str) -> dict[str, Any]:
    out = tmp_path / "formats.json"
    args = ["bench", "formats", "--formats", "fp32,bf16,int8,int4,gguf", "--decode-tokens", "9"]
    args += ["--rounds", "2", "--prompt-len", "40", "--batch-requests", "6", "--output", str(out), *extra]
    assert main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == printed
    return printed


def test_figures_ratios_and_chart(fake_bench: SimpleNamespace, tmp_path: Path, capsys) -> None:
    png = tmp_path / "chart.png"
    report = _run(tmp_path, capsys, "--png", str(png))
    assert list(report["formats"]) == ["fp32", "bf16", "int8", "int4", "gguf-q4_1"]
    machine = report["machine"]
    assert machine["mem_read_gbps"] == 10.0 and machine["fp32_gemm_gflops"] == 100.0
    assert set(machine["isa"]) == set(formats.ISA_FLAGS) and machine["cores"] >= 1 and machine["torch_threads"] >= 1
    assert report["workload"]["batch_input_len"] == "84:116" and report["workload"]["batch_output_len"] == 128
    fp32, int8, gguf = (report["formats"][k] for k in ("fp32", "int8", "gguf-q4_1"))
    assert fp32["decode_tok_s"] == pytest.approx(50.0) and fp32["ttft_ms"] == pytest.approx(200.0)
    assert fp32["batch_tok_s"] == pytest.approx(400.0) and len(fp32["decode_rounds_tok_s"]) == 2
    assert fp32["num_weights"] == formats.count_weights(CFG)
    assert fp32["bytes_per_weight"] == pytest.approx(4.0, rel=1e-6)
    assert fp32["decode_vs_fp32"] == pytest.approx(1.0)
    assert int8["decode_vs_fp32"] == pytest.approx(2.0) and int8["ttft_vs_fp32"] == pytest.approx(1.5)
    assert gguf["batch_vs_fp32"] == pytest.approx(2.0) and gguf["quantization"] == "gguf"
    # Decode against the bound of the format's own bytes, read at 10 GB/s.
    assert gguf["decode_fraction_of_bound"] == pytest.approx(150 * gguf["weight_bytes"] / 10e9)
    int4 = report["formats"]["int4"]  # its factory raises: reported, and the rest still measured
    assert int4["error"].startswith("ValueError") and "decode_tok_s" not in int4
    assert report["png"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_llm_is_freed_before_the_next_is_built(fake_bench: SimpleNamespace, tmp_path: Path, capsys) -> None:
    _run(tmp_path, capsys, "--png", "")
    keys = [("float32", "none"), ("bfloat16", "none"), (None, "int8"), (None, "gguf")]  # int4 fails to build
    assert fake_bench.events == [e for k in keys for e in (("build", k), ("free", k))]
    assert all(kw["enable_prefix_caching"] is False for kw in fake_bench.kwargs)


def test_the_requests_each_figure_runs(fake_bench: SimpleNamespace, tmp_path: Path, capsys) -> None:
    _run(tmp_path, capsys, "--formats", "fp32", "--png", "")
    # warm-up, 2 decode rounds, 2 TTFT rounds, the batch
    lengths = [lens for lens, _ in fake_bench.calls]
    params = [p for _, p in fake_bench.calls]
    assert [p.max_tokens for p in params] == [4, 9, 9, 1, 1, 128]
    assert lengths[1:5] == [[32], [32], [40], [40]]
    assert len(lengths[5]) == 6 and all(84 <= n <= 116 for n in lengths[5])
    assert all(p.ignore_eos and p.temperature == 0 for p in params)


def test_without_matplotlib_the_json_says_so(fake_bench: SimpleNamespace, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    png = tmp_path / "chart.png"
    report = _run(tmp_path, capsys, "--formats", "fp32", "--png", str(png))
    assert report["png"] is None and "matplotlib" in report["png_skipped"] and not png.exists()


def test_no_fp32_means_no_ratios(fake_bench: SimpleNamespace, tmp_path: Path, capsys) -> None:
    report = _run(tmp_path, capsys, "--formats", "int8", "--png", "")
    assert report["formats"]["int8"]["decode_vs_fp32"] is None


def test_format_list_is_checked() -> None:
    with pytest.raises(SystemExit):
        main(["bench", "formats", "--formats", "fp32,int3"])


@pytest.mark.parametrize("kind", ["llama_gqa_tied", "qwen2_gqa_bias", "llama_mha"])
def test_count_weights_matches_the_hf_model(tiny_model, kind: str) -> None:
    from cadenza.models.safetensors_loader import read_hf_config

    directory, hf = tiny_model(kind)
    assert formats.count_weights(read_hf_config(directory)) == sum(p.numel() for p in hf.parameters())


def test_isa_flags_and_cpu_info(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    first = "processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu avx2 avx512f amx_tile\n"
    cpuinfo.write_text(first + "\nprocessor\t: 1\nmodel name\t: Other CPU\n")
    name, flags = formats.cpu_info(str(cpuinfo))
    assert name == "Test CPU"
    assert formats.isa_flags(flags) == {
        "avx2": True, "avx512f": True, "avx512_bf16": False, "avx512_vnni": False, "amx": True
    }  # fmt: skip
    assert formats.cpu_info(str(tmp_path / "missing")) == ("unknown", set())


def test_gguf_label_is_the_stored_type(smollm_path: Path) -> None:
    assert formats.format_label("gguf", str(smollm_path)) == "gguf-q4_1"  # SmolLM2-135M-Instruct.Q4_1.gguf
    assert formats.format_label("int8", str(smollm_path)) == "int8"
