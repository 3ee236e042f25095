"""Every weight format on the real SmolLM2: perplexity on a fixed public-domain text
(tests/data/perplexity_text.txt, Emma ch. I), teacher-forced through the engine's own
prompt-logprobs path, against HF transformers' fp32 and against our fp32; greedy agreement
with fp32 over 16 prompts x 32 tokens; resident weight bytes against each format's size.

The measured values are printed (pytest -s) and quoted in docs/formats.md."""

from __future__ import annotations

import gc
import math
from pathlib import Path

import pytest
import torch

from cadenza import LLM, SamplingParams
from cadenza.kernels.quant.weight import PackedWeight
from cadenza.models.loader import DEFAULT_MODEL

TEXT = Path(__file__).parents[1] / "data" / "perplexity_text.txt"
PPL_TOKENS = 2048
# 16 x 32 greedy steps: a broken kernel diverges within a few tokens, and the batch's GEMMs
# are most of this module's time on a CPU without bf16 hardware.
PROMPTS, PROMPT_TOKENS, STEPS = 16, 16, 32
# name -> (LLM keyword arguments, largest perplexity change against fp32, as a fraction)
FORMATS = {
    "fp32": (dict(dtype="float32", quantization="none"), 0.0),
    "bf16": (dict(dtype="bfloat16", quantization="none"), 0.005),
    "int8": (dict(quantization="int8"), 0.01),
    "int4": (dict(quantization="int4"), 0.06),
    "gguf-q4_1": (dict(quantization="gguf"), 0.06),
    # The CPU's q4 kernels with x rounded to int8 per block of 32 (int8_activations): the
    # default on VNNI CPUs without AMX, bf16 ones included (a GGUF computes the rest in fp32
    # whatever dtype says, and the rounding displaces the bf16 GEMMs).
    "gguf-q4_1-a8": (dict(quantization="gguf", int8_activations=True), 0.06),
    # The default on AMX CPUs: prefill and batch GEMMs in bf16 (cpu_gemm_dtype).
    "gguf-q4_1-bf16gemm": (dict(quantization="gguf", cpu_gemm_dtype="bfloat16"), 0.06),
}
# Bytes per weight each format should hold (model.weight_bytes() / weights), within 10%:
# int4's LM head and embedding are int8 by design (models/packing.py), so its ideal mixes
# 0.625 B (codes + an fp16 scale and min per group of 32, the default) for the projections
# with ~1 B for the head; the GGUF's embedding is Q8_0.
PROJECTION_SHARE = 106_168_320 / 134_515_008  # SmolLM2's projections / all its weights
IDEAL_BYTES = {
    "fp32": 4.0,
    "bf16": 2.0,
    "int8": 1.0,
    "int4": PROJECTION_SHARE * 0.625 + (1 - PROJECTION_SHARE) * 1.0,
    "gguf-q4_1": PROJECTION_SHARE * 0.625 + (1 - PROJECTION_SHARE) * 1.0625,
}
IDEAL_BYTES["gguf-q4_1-a8"] = IDEAL_BYTES["gguf-q4_1-bf16gemm"] = IDEAL_BYTES["gguf-q4_1"]


def _tokens(llm: LLM) -> tuple[list[int], list[list[int]]]:
    tok = llm.get_tokenizer()
    text = TEXT.read_text()
    ids = tok.encode(text, add_special_tokens=False)[:PPL_TOKENS]
    paragraphs = [p for p in text.split("\n") if len(p) > 200]
    prompts = [tok.encode(p, add_special_tokens=False)[:PROMPT_TOKENS] for p in paragraphs[:PROMPTS]]
    return ids, prompts


def _perplexity(llm: LLM, ids: list[int]) -> float:
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    positions = out[0].prompt_logprobs[1:]
    logprobs = [position[token].logprob for position, token in zip(positions, ids[1:], strict=True)]
    return math.exp(-sum(logprobs) / len(logprobs))


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _weights(llm: LLM) -> int:
    cfg = llm.engine.model_config
    per_layer = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size
    per_layer += 3 * cfg.hidden_size * cfg.intermediate_size + 2 * cfg.hidden_size
    return cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size + cfg.hidden_size


def _resident_bytes(model: torch.nn.Module) -> int:
    """Distinct storage reachable from the model's parameters, buffers and packed weights."""
    seen: dict[int, int] = {}
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        packed = getattr(module, "packed", None)  # a Linear's parts, or a PackedEmbedding's table
        parts = packed if isinstance(packed, list) else [packed] if isinstance(packed, PackedWeight) else []
        tensors += [t for part in parts for t in part.tensors()]
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values()) - sum(b.untyped_storage().nbytes() for b in model.buffers())


@pytest.fixture(scope="module")
def measured(hf_smollm) -> dict[str, dict]:
    results: dict[str, dict] = {}
    for name, (kwargs, _) in FORMATS.items():
        llm = LLM(DEFAULT_MODEL, num_blocks=512, enable_prefix_caching=False, **kwargs)
        ids, prompts = _tokens(llm)
        model = llm.engine.runner.model
        results[name] = {
            "ppl": _perplexity(llm, ids),
            "greedy": _greedy(llm, prompts),
            "bytes_per_weight": model.weight_bytes() / _weights(llm),
            "resident_per_weight": _resident_bytes(model) / _weights(llm),
            "label": model.weights_label,
            "ids": ids,
        }
        del llm, model
        gc.collect()
    with torch.no_grad():
        ids = results["fp32"]["ids"]
        logits = hf_smollm(torch.tensor([ids])).logits[0, :-1]
    logprobs = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(ids[1:])[:, None])
    results["hf"] = {"ppl": math.exp(-logprobs.mean().item())}
    _report(results)
    return results


def _agreement(ours: list[list[int]], ref: list[list[int]]) -> float:
    """Mean share of the STEPS steps before the first token that differs from fp32's."""
    shares = []
    for a, b in zip(ours, ref, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
        shares.append(same / len(b))
    return sum(shares) / len(shares)


def _report(results: dict[str, dict]) -> None:
    print(f"\nperplexity over {PPL_TOKENS} tokens: HF fp32 {results['hf']['ppl']:.4f}")
    for name in FORMATS:
        r = results[name]
        agree = _agreement(r["greedy"], results["fp32"]["greedy"])
        print(
            f"{name:10s} {r['label']:10s} ppl {r['ppl']:.4f} ({r['ppl'] / results['fp32']['ppl'] - 1:+.2%} vs fp32)"
            f"  greedy agreement {agree:.1%}  {r['bytes_per_weight']:.3f} B/weight"
            f" (resident {r['resident_per_weight']:.3f})"
        )


def test_fp32_perplexity_matches_transformers(measured: dict[str, dict]) -> None:
    assert abs(measured["fp32"]["ppl"] / measured["hf"]["ppl"] - 1) <= 0.001


@pytest.mark.parametrize("name", [n for n in FORMATS if n != "fp32"])
def test_each_format_keeps_perplexity_within_its_bound(measured: dict[str, dict], name: str) -> None:
    change = measured[name]["ppl"] / measured["fp32"]["ppl"] - 1
    assert change <= FORMATS[name][1], f"{name}: perplexity {change:+.2%} against fp32"


@pytest.mark.parametrize("name", [n for n in FORMATS if n != "fp32"])
def test_greedy_tokens_agree_with_fp32(measured: dict[str, dict], name: str) -> None:
    """A floor well under what each format measures (docs/formats.md), so a broken kernel fails it."""
    floor = 0.5 if name in ("bf16", "gguf-q4_1") else 0.15
    assert _agreement(measured[name]["greedy"], measured["fp32"]["greedy"]) >= floor


@pytest.mark.parametrize("name", list(FORMATS))
def test_resident_weight_bytes_are_the_formats_size(measured: dict[str, dict], name: str) -> None:
    """Within 10% of the format's ideal, counting every storage the model holds (so a second
    copy of the weights, dense or packed, would fail it)."""
    ideal = IDEAL_BYTES[name]
    assert abs(measured[name]["bytes_per_weight"] / ideal - 1) <= 0.10
    assert abs(measured[name]["resident_per_weight"] / ideal - 1) <= 0.10
