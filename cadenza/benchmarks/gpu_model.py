"""The GPU check's whole-model part: Cadenza's engine (LLM, no Ray) against transformers with
the same random weights, and its decode speed against the device's bandwidth.

A random-weight Llama is built where the check runs (no weights travel): Llama-3.2-1B's shape
on a GPU, a tiny one for the CPU dry run. In the check's dtype it reports:
- the greedy tokens of one prompt over `steps` steps, ours and transformers' (its
  generate(), the same weights, the same dtype), the first position where they differ, and
  the largest |log-prob difference| of the chosen tokens, teacher-forced over the whole text;
- decode TPOT at each batch size (requests of `decode_tokens` tokens, timed from each
  request's first to last token);
- a batch-1 decode step's bytes (weights + the KV it reads) over its TPOT, as a fraction of
  the device's copy bandwidth measured in the same run.
Each engine mode runs it: on CUDA with decode graphs and async scheduling (the defaults,
`graphs`), graphs without async scheduling (`graphs_sync`) and eager (`eager`); on the CPU,
where there are no graphs, eager with async scheduling off (its default there) and on
(`eager_async`). `async_speedup` is, per batch, TPOT without it over TPOT with it.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

# Llama-3.2-1B's shape (its config.json), with random weights.
LLAMA_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=4096, rope_theta=500000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)  # fmt: skip
TINY_LLAMA = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)  # fmt: skip
PROMPT_LEN = 32
# The engine settings of each mode the check runs (see the docstring).
CUDA_MODES = {
    "graphs": dict(enforce_eager=False, async_scheduling=True),
    "graphs_sync": dict(enforce_eager=False, async_scheduling=False),
    "eager": dict(enforce_eager=True),
}
CPU_MODES = {"eager": dict(enforce_eager=True), "eager_async": dict(enforce_eager=True, async_scheduling=True)}


def build_random_llama(shape: dict[str, Any], dtype: torch.dtype, directory: Path, seed: int = 0) -> torch.nn.Module:
    """A transformers Llama of this shape, weights scaled so its logits are peaked (greedy
    tokens then rarely sit on a near-tie), saved to `directory`; returned in `dtype`."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "norm" in name else 0.05) + (1.0 if "norm" in name else 0.0))
    model.to(dtype).save_pretrained(directory)
    return model


def copy_bandwidth_gb_s(device: torch.device, nbytes: int) -> float:
    """Device memory bandwidth by a large copy (read + write counted), best of a few."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def greedy_vs_hf(llm: Any, hf: torch.nn.Module, prompt: list[int], steps: int, device: torch.device) -> dict[str, Any]:
    from cadenza.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=1)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        theirs = hf.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None)
        theirs = theirs[0, len(prompt) :].tolist()
        forced = torch.log_softmax(hf(torch.tensor([prompt + out.token_ids], device=device)).logits[0].float(), -1)
    diffs = [
        abs(top[token].logprob - float(forced[len(prompt) - 1 + i, token]))
        for i, (token, top) in enumerate(zip(out.token_ids, out.logprobs, strict=True))
    ]
    first = next((i for i, (a, b) in enumerate(zip(out.token_ids, theirs, strict=True)) if a != b), None)
    return {
        "steps": steps,
        "greedy_identical": first is None,
        "first_difference": first,
        "max_logprob_diff": max(diffs),
        "mean_logprob_diff": statistics.mean(diffs),
    }


def decode_tpot_ms(llm: Any, vocab: int, batch: int, tokens: int) -> float:
    """Median over requests of (last token - first token) / (tokens - 1), batch requests at once."""
    from cadenza.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(batch)
    prompts = [{"prompt_token_ids": torch.randint(0, vocab, (PROMPT_LEN,), generator=g).tolist()} for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    per_token = [
        (m.last_token_time - m.first_token_time) / (tokens - 1) for o in outs for m in o.metrics[:1] if tokens > 1
    ]
    return 1e3 * statistics.median(per_token)


def model_check(
    tiny: bool, device: torch.device, dtype: torch.dtype, steps: int = 64, batches: tuple[int, ...] = (1, 8, 64)
) -> dict[str, Any]:
    """The whole-model report (see the module's docstring), one engine per mode."""
    shape = TINY_LLAMA if tiny else LLAMA_1B
    name = str(dtype).removeprefix("torch.")
    modes = CUDA_MODES if device.type == "cuda" else CPU_MODES
    with tempfile.TemporaryDirectory() as directory:
        hf = build_random_llama(shape, dtype, Path(directory)).to(device=device, dtype=dtype)
        prompt = torch.randint(0, shape["vocab_size"], (PROMPT_LEN,), generator=torch.Generator().manual_seed(7))
        report: dict[str, Any] = {"model": "tiny-llama" if tiny else "llama-3.2-1b-shaped", "dtype": name}
        for mode, engine in modes.items():
            report[mode] = _engine_report(directory, hf, prompt.tolist(), shape, device, name, engine, steps, batches)
    first = report[next(iter(modes))]
    report["vs_transformers"] = {
        "greedy_identical": all(report[m]["vs_transformers"]["greedy_identical"] for m in modes)
    }
    if "graphs" in report:
        report["graphs_speedup_batch1"] = round(report["eager"]["tpot_ms"]["1"] / report["graphs"]["tpot_ms"]["1"], 2)
    on, off = ("graphs", "graphs_sync") if "graphs" in report else ("eager_async", "eager")
    report["async_speedup"] = {
        b: round(report[off]["tpot_ms"][b] / report[on]["tpot_ms"][b], 3) for b in report[on]["tpot_ms"]
    }
    report["decode_step_fraction_of_bandwidth"] = first["decode_step_fraction_of_bandwidth"]
    return report


def _engine_report(
    directory: str, hf: torch.nn.Module, prompt: list[int], shape: dict[str, Any], device: torch.device,
    dtype: str, engine: dict[str, bool], steps: int, batches: tuple[int, ...],
) -> dict[str, Any]:  # fmt: skip
    """One engine's figures (engine: its mode's settings); on CUDA its KV pool sized by a
    profile (gpu_memory_utilization)."""
    from cadenza.actors.llm import LLM

    sizing = {"gpu_memory_utilization": 0.3} if device.type == "cuda" else {"num_blocks": (max(batches) + 1) * 8}
    settings = dict(dtype=dtype, device=str(device), block_size=16, max_num_seqs=max(batches), **engine)
    llm = LLM(directory, **settings, **sizing)
    decode_tokens = 16 if shape is TINY_LLAMA else 64
    report: dict[str, Any] = {"kv_pool_blocks": llm.engine.num_blocks}
    report["vs_transformers"] = greedy_vs_hf(llm, hf, prompt, steps, device)
    report["tpot_ms"] = {str(b): round(decode_tpot_ms(llm, shape["vocab_size"], b, decode_tokens), 3) for b in batches}
    report |= _bandwidth(llm, shape, device, report["tpot_ms"]["1"], decode_tokens)
    graphs = llm.engine.runner.graphs
    report["graph_replays"] = {str(k): v for k, v in graphs.replays.items() if v} if graphs is not None else None
    del llm
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the next engine profiles a device without this one's pool
    return report


def _bandwidth(llm: Any, shape: dict[str, Any], device: torch.device, tpot_ms: float, tokens: int) -> dict[str, Any]:
    """Bytes a batch-1 decode step reads (weights + its KV at the mean context) over its time."""
    model = llm.engine.runner.model
    context = PROMPT_LEN + tokens // 2
    kv_row = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"]
    step_bytes = model.weight_bytes() + kv_row * context * model.norm.element_size()
    measured = copy_bandwidth_gb_s(device, 1 << 30 if device.type == "cuda" else 1 << 26)
    achieved = step_bytes / (tpot_ms / 1e3) / 1e9
    return {
        "decode_step_bytes": step_bytes,
        "copy_bandwidth_gb_s": round(measured, 1),
        "decode_step_gb_s": round(achieved, 1),
        "decode_step_fraction_of_bandwidth": round(achieved / measured, 3),
    }
