"""`cadenza bench spec`: single-stream decode speed with speculative decoding, as JSON.

Input-grounded chat prompts (repeat, correct, or edit a given text), where the answer
copies runs of the prompt: the case n-gram prompt lookup is for. The same greedy requests
run without speculation, with n-gram drafts and with a draft model, in the same process
and alternating, so the speed-ups are ratios against a baseline measured in the same run;
greedy outputs must be identical across the three (the bench checks it).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from cadenza.benchmarks.report import report
from cadenza.outputs import RequestOutput
from cadenza.sampling_params import SamplingParams

# Written for this benchmark: plain prose and code of the kind users paste into a chat.
TEXTS = [
    "The river town wakes slowly. Fishing boats leave before dawn, the bakery opens at six, "
    "and by eight the market square is full of stalls selling apples, cheese and bread. "
    "In the afternoon the streets are quiet again, and the old men play chess by the fountain.",
    "def moving_average(values, window):\n    result = []\n    total = 0.0\n"
    "    for i, value in enumerate(values):\n        total += value\n        if i >= window:\n"
    "            total -= values[i - window]\n        if i >= window - 1:\n"
    "            result.append(total / window)\n    return result\n",
    "Our team meets every Monday at ten to plan the week. Each person shares what they "
    "finished, what they will work on next, and anything that blocks them. Notes go into the "
    "shared document so that people who missed the meeting can catch up before lunch.",
]
TASKS = [
    "Repeat the following text exactly, word for word:\n\n{text}",
    "Fix any spelling or grammar mistakes in this text and return the whole corrected text:\n\n{text}",
    "Rewrite the following text, keeping every sentence, and put each sentence on its own line:\n\n{text}",
]


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--draft-model", default=None, help="draft for the draft-model figure (default: the target)")
    p.add_argument("--draft-num-layers", type=int, default=8, help="keep the draft's first layers (self-speculation)")
    p.add_argument("--no-draft", action="store_true", help="skip the draft-model figure")
    p.add_argument("--repeats", type=int, default=2, help="alternating rounds over all prompts")
    p.add_argument("--output", default=None, help="also write the JSON here")


def prompts() -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": task.format(text=text)}] for text in TEXTS for task in TASKS]


def decode_tok_s(outputs: list[RequestOutput]) -> float:
    """Decode tokens over decode time (first token to last), summed over the requests."""
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
    seconds = sum(o.metrics[0].last_token_time - o.metrics[0].first_token_time for o in outputs)
    return tokens / seconds


def run_round(llm: Any, chats: list, params: SamplingParams) -> list[RequestOutput]:
    """One request at a time: the single-stream case speculation serves."""
    return [llm.chat(chat, params)[0] for chat in chats]


def spec_summary(llm: Any) -> dict[str, Any]:
    s = llm.engine.stats().spec_decode
    steps = max(s.num_drafts, 1)
    return {
        "num_drafts": s.num_drafts,
        "num_draft_tokens": s.num_draft_tokens,
        "num_accepted_tokens": s.num_accepted_tokens,
        "acceptance_rate": s.num_accepted_tokens / max(s.num_draft_tokens, 1),
        # Tokens a verification step emits: the accepted drafts plus the corrected/bonus token.
        "mean_accepted_length": 1 + s.num_accepted_tokens / steps,
        "acceptance_per_position": [a / steps for a in s.accepted_per_position],
    }


def run_spec_bench(args: argparse.Namespace, engine_args: dict[str, Any]) -> dict[str, Any]:
    from cadenza.actors.llm import LLM

    k = args.num_speculative_tokens
    configs: dict[str, dict | None] = {"baseline": None, "ngram": {"method": "ngram", "num_speculative_tokens": k}}
    if not args.no_draft:
        configs["draft_model"] = {
            "method": "draft_model",
            "model": args.draft_model or args.model,
            "num_speculative_tokens": k,
            "draft_num_layers": args.draft_num_layers,
        }
    engine_args = {key: v for key, v in engine_args.items() if key != "speculative_config"}
    llms = {name: LLM(args.model, speculative_config=spec, **engine_args) for name, spec in configs.items()}
    chats = prompts()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for llm in llms.values():
        run_round(llm, chats[:1], params)  # warm-up
    speeds: dict[str, list[float]] = {name: [] for name in llms}
    texts: dict[str, list[str]] = {}
    for _ in range(args.repeats):
        for name, llm in llms.items():
            outs = run_round(llm, chats, params)
            speeds[name].append(decode_tok_s(outs))
            texts[name] = [o.outputs[0].text for o in outs]
    base = statistics.median(speeds["baseline"])
    result: dict[str, Any] = {"model": args.model, "num_prompts": len(chats), "max_tokens": args.max_tokens, "k": k}
    result["baseline"] = {"decode_tok_s": base}
    for name in llms:
        if name == "baseline":
            continue
        tok_s = statistics.median(speeds[name])
        result[name] = {
            "decode_tok_s": tok_s,
            "speedup_vs_baseline": tok_s / base,
            "greedy_equal_to_baseline": texts[name] == texts["baseline"],
            **spec_summary(llms[name]),
        }
    if "draft_model" in configs:
        result["draft_model"]["draft"] = configs["draft_model"]
    return report(result, args.output)
