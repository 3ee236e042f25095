"""`cadenza bench serve --disaggregation 1P1D`: one workload on a colocated server and a 1P1D
one, started in turn, reported side by side with their ratios and the hand-overs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cadenza.cli.main import main


@pytest.mark.slow
def test_the_bench_runs_both_servers_and_reports_ratios(
    ray_cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:  # noqa: ANN001
    import ray
    from cadenza_testkit.tiny_models import build_tiny_chat_model

    model = build_tiny_chat_model(tmp_path / "tiny")
    serve_args = (
        f"{model} --served-model-name tiny --num-blocks 128 --ray-address {ray.get_runtime_context().gcs_address}"
        " --max-local-prefill-tokens 0"  # every prompt handed over
    )
    argv = ["bench", "serve", "--disaggregation", "1P1D", "--serve-args", serve_args, "--model", "tiny"]
    argv += ["--num-prompts", "6", "--input-words", "30:60", "--output-len", "4:8", "--concurrency", "2"]
    argv += ["--long-prompt-words", "45"]  # both kinds in six prompts of 30-60 words (seed 0)
    assert main([*argv, "--output", str(tmp_path / "pd.json")]) == 0
    result = json.loads((tmp_path / "pd.json").read_text())
    colocated, split = result["modes"]["colocated"], result["modes"]["1P1D"]
    assert colocated["completed"] == split["completed"] == 6 and colocated["kv_transfer"] is None
    assert split["kv_transfer"]["num_handoffs"] == 6 and split["kv_transfer"]["num_blocks_imported"] > 0
    assert result["ratios_split_over_colocated"]["itl_ms_p50"] > 0
    for mode in (colocated, split):  # the short and the long prompts apart
        kinds = mode["by_prompt"]
        assert kinds["short"]["completed"] + kinds["long"]["completed"] == 6 and kinds["long_prompt_words"] == 45
        assert kinds["short"]["itl_ms"]["p99"] > 0 and kinds["long"]["ttft_ms"]["p50"] > 0
    assert result["ratios_split_over_colocated"]["short_itl_ms_p99"] > 0
