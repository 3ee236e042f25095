"""`cadenza bench serve` against a gateway on a paced engine: the measuring, not the model."""

from __future__ import annotations

import json

import pytest
from cadenza_testkit.servers import ARTIFACTS, PacedEngine, free_port, serve_in_thread

from cadenza.cli.main import main
from cadenza.gateway.app import build_app
from cadenza.gateway.settings import GatewaySettings
from cadenza.models.loader import DEFAULT_MODEL

pytestmark = pytest.mark.heavy  # not in make test-quick: a server and the serving benchmark against it


@pytest.mark.parametrize("transport", ["http", "ws"])
def test_bench_serve_reports_latencies_throughput_and_a_plot(transport: str, capsys) -> None:
    port = free_port()
    pace = 0.02
    app = build_app(PacedEngine(pace=pace), DEFAULT_MODEL, GatewaySettings(port=port))
    plot = ARTIFACTS / f"bench_serve_{transport}.png"
    ARTIFACTS.mkdir(exist_ok=True)
    args = ["bench", "serve", "--url", f"http://127.0.0.1:{port}", "--transport", transport]
    args += ["--num-prompts", "8", "--concurrency", "4", "--output-len", "10:10", "--slo-ttft-ms", "10000"]
    args += ["--plot", str(plot)]
    with serve_in_thread(app, port):
        assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["completed"] == 8 and report["failed"] == 0 and report["model"] == DEFAULT_MODEL
    assert report["output_token_throughput"] > 0 and report["goodput"] == report["request_throughput"]
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        assert report[key]["p50"] <= report[key]["p90"] <= report[key]["p99"]
    # The engine emits a token every `pace` seconds: ITL and TPOT sit at or above it.
    assert report["itl_ms"]["p50"] >= pace * 1e3 * 0.8 and report["tpot_ms"]["p50"] >= pace * 1e3 * 0.8
    assert plot.stat().st_size > 10_000


def test_bench_serve_poisson_arrivals_from_a_prompt_file(tmp_path, capsys) -> None:
    port = free_port()
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(json.dumps({"prompt": f"question {i}", "max_tokens": 3 + i}) for i in range(5)))
    app = build_app(PacedEngine(pace=0.005), DEFAULT_MODEL, GatewaySettings(port=port))
    args = ["bench", "serve", "--url", f"http://127.0.0.1:{port}", "--num-prompts", "10", "--request-rate", "50"]
    args += ["--dataset", str(dataset), "--slo-ttft-ms", "0.001"]
    with serve_in_thread(app, port):
        assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["completed"] == 10 and report["request_rate"] == 50
    assert report["goodput"] == 0  # nobody meets a 1 microsecond TTFT
    assert report["output_token_throughput"] * report["elapsed_s"] == pytest.approx(sum(3 + i % 5 for i in range(10)))


def test_bench_serve_compare_offline_runs_the_same_prompts_in_process(capsys) -> None:
    """The served run and an in-process LLM on the same prompts, and the ratios between them."""
    from cadenza.actors.inprocess_client import InProcessClient

    port = free_port()
    engine = InProcessClient(DEFAULT_MODEL, num_blocks=256)
    app = build_app(engine, DEFAULT_MODEL, GatewaySettings(port=port))
    args = ["bench", "serve", "--url", f"http://127.0.0.1:{port}", "--num-prompts", "3", "--concurrency", "1"]
    args += ["--input-words", "8:12", "--output-len", "6:6", "--compare-offline"]
    try:
        with serve_in_thread(app, port):
            assert main(args) == 0
    finally:
        engine.shutdown()
    report = json.loads(capsys.readouterr().out)
    offline = report["in_process"]
    assert report["completed"] == offline["completed"] == 3 and offline["model"] == DEFAULT_MODEL
    assert offline["output_token_throughput"] * offline["elapsed_s"] == pytest.approx(3 * 6)
    assert offline["ttft_ms"]["p50"] > 0 and offline["tpot_ms"]["p50"] > 0
    assert set(report["overhead"]) == {
        "ttft_ms_p50",
        "ttft_ms_mean",
        "tpot_ms_p50",
        "tpot_ms_mean",
        "output_throughput",
    }
    assert all(v > 0 for v in report["overhead"].values())


def test_bench_serve_compare_offline_refuses_poisson_arrivals() -> None:
    with pytest.raises(SystemExit, match="request-rate"):
        main(["bench", "serve", "--request-rate", "5", "--compare-offline"])
