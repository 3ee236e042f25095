"""Decode graphs wired into the ModelRunner, through the CPU stand-in capture of
test_cuda_graphs.py: a graphed engine gives the eager engine's tokens and log-probs while
decode-only steps replay graphs (padded to the ladder) and every other step runs eagerly;
and where graphs are used at all (graph_settings)."""

from __future__ import annotations

import pytest
import torch
from cadenza_testkit.graph_capture import stand_in_capture

from cadenza import LLM, SamplingParams
from cadenza.actors.cuda_graphs import GraphSettings, cuda_capture, graph_settings
from cadenza.actors.model_runner import ModelRunner

pytestmark = pytest.mark.heavy  # not in make test-quick: captured graphs against eager, step after step

MAX_NUM_SEQS = 5  # ladder 1, 2, 4, 5
PROMPTS = [[3, 14, 15, 92, 65], [35, 89], [79, 32, 38, 46, 26, 43, 38, 32], [27], [95, 2, 88, 41], [7, 7, 7]]


def _run(llm: LLM) -> list[tuple[list[int], list[float]]]:
    # Different lengths, so the running batch shrinks through every rung as requests finish.
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True, logprobs=0) for i in range(6)]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    chosen = lambda c: [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)]  # noqa: E731
    return [(o.outputs[0].token_ids, chosen(o.outputs[0])) for o in outs]


def _graphed(llm: LLM, max_num_seqs: int = MAX_NUM_SEQS) -> ModelRunner:
    """The engine's runner again over the same model (and proposer), capturing with the stand-in."""
    old = llm.engine.runner
    settings = GraphSettings(max_num_seqs, llm.engine.max_model_len, stand_in_capture)
    blocks, size, eos = llm.engine.num_blocks, old.block_size, old.eos_token_ids
    runner = ModelRunner(old.model, blocks, size, eos, proposer=old.proposer, graphs=settings)
    llm.engine.runner = runner
    return runner


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_graphed_decode_equals_eager(tiny_model, monkeypatch: pytest.MonkeyPatch, kernels: str) -> None:
    """`triton` runs the split-KV decode kernel (interpreted here) with the graph's fixed
    grid: partitions sized for max_model_len, most of them empty for these short contexts."""
    monkeypatch.setenv("CADENZA_KERNELS", kernels)
    path, _ = tiny_model("llama_gqa_tied")
    llm = LLM(str(path), max_num_seqs=MAX_NUM_SEQS, num_blocks=64, max_model_len=256, enable_prefix_caching=False)
    eager = _run(llm)
    runner = _graphed(llm)
    graphed = _run(llm)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(graphed, eager, strict=True):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-4
    replays = runner.graphs.replays
    assert replays[5] > 0 and replays[4] > 0 and replays[2] > 0 and replays[1] > 0, replays
    # Graphs only run decodes: each request's first token came from an eager (prefill) step.
    decode_tokens = sum(len(tokens) - 1 for tokens, _ in graphed)
    assert sum(replays.values()) < decode_tokens  # several requests share each replayed step


def test_graphed_verification_equals_eager(tiny_model, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under n-gram speculation a verify step's k + 1 tokens a request replay as rows."""
    monkeypatch.setenv("CADENZA_KERNELS", "torch")
    path, _ = tiny_model("llama_gqa_tied")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    settings = dict(max_num_seqs=16, num_blocks=64, max_model_len=256, enable_prefix_caching=False)
    plain = _run(LLM(str(path), **settings))
    llm = LLM(str(path), **settings, speculative_config=spec)
    runner = _graphed(llm, max_num_seqs=16)
    steps: list[tuple[int, int, bool]] = []  # (requests sampled, tokens, replayed)
    replay = runner._replay

    def recording(batch):  # noqa: ANN001, ANN202 - the runner's own types
        logits = replay(batch)
        steps.append((len(batch.sampling), batch.input_ids.shape[0], logits is not None))
        return logits

    monkeypatch.setattr(runner, "_replay", recording)
    graphed = _run(llm)
    assert [tokens for tokens, _ in graphed] == [tokens for tokens, _ in plain]
    assert any(replayed and tokens > reqs for reqs, tokens, replayed in steps), steps  # a verify step
    assert llm.stats().spec_decode.num_accepted_tokens > 0


def test_the_padding_scratch_block_is_past_the_pool(tiny_model) -> None:
    path, _ = tiny_model("llama_gqa_tied")
    llm = LLM(str(path), max_num_seqs=MAX_NUM_SEQS, num_blocks=16, max_model_len=128)
    runner = _graphed(llm)
    assert runner.kv_caches[0][0].shape[0] == 17  # the pool's 16 blocks and the scratch
    assert runner.graphs.pad_block == 16 and runner.graphs.pad_slot == 16 * runner.block_size
    assert llm.engine.kv.pool.num_blocks == 16  # the scheduler never hands the scratch out


def test_graphs_stay_off_where_they_cannot_run() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert graph_settings(False, cuda, True, "triton", 8, 1024) == GraphSettings(8, 1024, cuda_capture)
    assert graph_settings(True, cuda, True, "triton", 8, 1024) is None  # enforce_eager
    assert graph_settings(False, cpu, True, "cpu", 8, 1024) is None
    assert graph_settings(False, cuda, False, "triton", 8, 1024) is None  # a pipeline stage
    assert graph_settings(False, cuda, True, "torch", 8, 1024) is None  # the reference syncs


def test_an_engine_on_the_cpu_has_no_graphs_and_takes_the_flags(tiny_model) -> None:
    path, _ = tiny_model("llama_gqa_tied")
    llm = LLM(str(path), num_blocks=8, enforce_eager=True, gpu_memory_utilization=0.5)
    assert llm.engine.runner.graphs is None and llm.config.enforce_eager
    assert llm.engine.runner.kv_caches[0][0].shape[0] == 8
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        LLM(str(path), gpu_memory_utilization=1.5)
