"""The `cadenza` command line, run as a user would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cadenza_testkit.servers import ARTIFACTS, VLLM_LINE, launch_server
from cadenza_testkit.tiny_models import build_tiny_chat_model

pytestmark = pytest.mark.heavy  # not in make test-quick: the `cadenza` command end to end, its benchmark too

CLI = [str(Path(sys.executable).parent / "cadenza")]


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + list(args), input=stdin, capture_output=True, text=True, timeout=600)


def test_generate() -> None:
    out = run("generate", "--max-tokens", "8", "The capital of France is")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_chat_streams_replies() -> None:
    out = run("chat", "--temperature", "0", "--max-tokens", "16", stdin="What is the capital of France?\n/exit\n")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_bad_model_is_one_clear_line() -> None:
    out = run("generate", "--model", "/no/such/model", "hi")
    assert out.returncode == 2
    assert out.stderr.strip().startswith("cadenza: error: model '/no/such/model'")


def test_bench_offline_prints_json(tmp_path: Path) -> None:
    """On a tiny model with SmolLM2's tokenizer: the report's shape and its HF baseline are the
    point here, and SmolLM2 through transformers' GGUF loader took 35 s of the test's 38."""
    target = tmp_path / "bench.json"
    out = run(
        "bench",
        "offline",
        "--model",
        str(build_tiny_chat_model(tmp_path / "chat")),
        "--num-requests",
        "3",
        "--input-len",
        "8:16",
        "--output-len",
        "4:8",
        "--single-stream-tokens",
        "8",
        "--single-stream-rounds",
        "2",
        "--baseline",
        "hf",
        "--contexts",
        "0,64",
        "--sweep-rounds",
        "2",
        "--output",
        str(target),
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(target.read_text())
    assert json.loads(out.stdout[out.stdout.index("{") :]) == result
    assert 3 * 4 <= result["cadenza"]["output_tokens"] <= 3 * 8
    for key in ("fp32_gemm_gflops", "mem_read_gbps", "decode_bound_tok_s"):
        assert result["machine"][key] > 0
    assert result["cadenza"]["output_tok_s"] > 0 and result["hf"]["output_tok_s"] > 0
    assert result["output_tok_s_ratio_vs_hf"] > 0
    for side in ("cadenza", "hf"):  # --single-stream-rounds 2: each paired with its own bound
        rounds = result[side]["single_stream_rounds"]
        assert len(rounds) == 2 and all(r["mem_read_gbps"] > 0 and r["decode_tok_s"] > 0 for r in rounds)
    sweep = result["context_sweep"]
    assert list(sweep) == ["0", "64"] and sweep["64"]["prompt_tokens"] == 64
    for row in sweep.values():
        assert row["ttft_s"] > 0 and row["decode_tok_s"] > 0 and row["flops_bound_s"] > 0
        assert row["gemm_flops"] > 0 and row["attention_flops"] > 0 and row["ttft_over_bound"] > 0
        assert len(row["rounds"]) == 2 and row["decode_tok_s"] > 0  # medians of 2 interleaved rounds
        assert result[side]["single_stream_fraction_of_bound"] in [r["fraction"] for r in rounds]
    assert [r["decode_vs_start"] for r in sweep["0"]["rounds"]] == [1.0, 1.0]  # each round's own start


def test_bench_offline_rejects_zero_rounds() -> None:
    out = run("bench", "offline", "--single-stream-rounds", "0")
    assert out.returncode == 2
    assert "--single-stream-rounds: must be a whole number >= 1, got '0'" in out.stderr


def test_a_vllm_command_line_serves_a_request(ray_cluster, tmp_path: Path) -> None:
    model = build_tiny_chat_model(tmp_path / "chat")
    with launch_server([str(model), *VLLM_LINE.split()], "vllm_cli.log") as server:
        body = {"model": str(model), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        status, reply = server.post("/v1/chat/completions", json.dumps(body).encode())
        assert status == 200 and reply["usage"]["completion_tokens"] == 4, reply
    log = (ARTIFACTS / "vllm_cli.log").read_text()
    assert "ignoring vLLM flags that mean nothing here: --enable-auto-tool-choice" in log
    assert "cadenza.requests" in log and "4 output tokens" in log  # the request log line at info
