"""`cadenza` command line: generate, chat, bench."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from cadenza.config import DEFAULT_MODEL
from cadenza.engine_args import add_engine_args, apply_hub_flags, engine_kwargs
from cadenza.version import package_version
from cadenza.vllm_flags import take_positional_model, warn_ignored


def _sampling_args(p: argparse.ArgumentParser, temperature: float) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=temperature)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--priority", type=int, default=0, help="lower runs first (the priority scheduling policy)")


def _make_llm(args: argparse.Namespace):  # noqa: ANN202 - cadenza.LLM, imported late for a fast --help
    from cadenza.actors.llm import LLM

    return LLM(args.model, **engine_kwargs(args))


def _params(args: argparse.Namespace):  # noqa: ANN202
    from cadenza.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)


def cmd_generate(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    params = _params(args)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outs = llm.generate(args.prompts, params, use_tqdm=False, priority=[args.priority] * len(args.prompts))
    for out in outs:
        print(out.outputs[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    tokenizer = llm.get_tokenizer()
    params = _params(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    print(f"cadenza chat on {args.model}. /reset clears the conversation, /exit or Ctrl-D quits.", flush=True)
    while (line := _read_line()) is not None:
        if line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        prompt = {"prompt": tokenizer.apply_chat_template(history), "chat": True}
        reply = ""
        for delta in llm.stream(prompt, params):
            reply += delta
            print(delta, end="", flush=True)
        print(flush=True)
        history.append({"role": "assistant", "content": reply})
    return 0


def _read_line() -> str | None:
    try:
        return input("> " if sys.stdin.isatty() else "")
    except EOFError:
        return None


def cmd_bench_offline(args: argparse.Namespace) -> int:
    from cadenza.benchmarks.offline import run_offline_bench

    run_offline_bench(args)
    return 0


def cmd_bench_moe(args: argparse.Namespace) -> int:
    from cadenza.benchmarks.moe import run_moe_bench

    run_moe_bench(args)
    return 0


def cmd_bench_actors(args: argparse.Namespace) -> int:
    from cadenza.benchmarks.actors import run_actor_bench

    run_actor_bench(args)
    return 0


def cmd_bench_spec(args: argparse.Namespace) -> int:
    from cadenza.benchmarks.spec import run_spec_bench

    run_spec_bench(args, engine_kwargs(args))
    return 0


def cmd_bench_moved_session(args: argparse.Namespace) -> int:
    from cadenza.benchmarks.moved_session import run_moved_session_bench

    run_moved_session_bench(args)
    return 0


def cmd_bench_shared_log(args: argparse.Namespace) -> int:
    from cadenza.benchmarks.shared_log import run_shared_log_bench

    run_shared_log_bench(args)
    return 0


def cmd_bench_shared_document(args: argparse.Namespace) -> int:
    from cadenza.benchmarks.shared_document import run_shared_document_bench

    run_shared_document_bench(args)
    return 0


def cmd_bench_formats(args: argparse.Namespace) -> int:
    from cadenza.benchmarks.formats import run_formats_bench

    run_formats_bench(args)
    return 0


def cmd_bench_structured(args: argparse.Namespace) -> int:
    from cadenza.benchmarks.structured import run_structured_bench

    run_structured_bench(args)
    return 0


def cmd_gpu_check(args: argparse.Namespace) -> int:
    from cadenza.benchmarks.gpu_check import run_gpu_check

    return run_gpu_check(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from cadenza.gateway.server import run_server

    run_server(args)
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from cadenza.benchmarks.serve import run_serve_bench

    run_serve_bench(args)
    return 0


def _resolve_model(args: argparse.Namespace) -> None:
    """The model: `cadenza serve MODEL` or --model, else the packaged default."""
    if not hasattr(args, "model"):
        return
    args.model_given = args.model is not None
    take_positional_model(args)
    if args.model is None:
        args.model = DEFAULT_MODEL


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cadenza", description="Cadenza LLM inference")
    parser.add_argument("--version", action="version", version=f"cadenza {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one or more prompts and print the text")
    add_engine_args(gen)
    _sampling_args(gen, temperature=0.0)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message")
    gen.add_argument("prompts", nargs="+")
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="terminal chat that streams tokens as they are sampled")
    add_engine_args(chat)
    _sampling_args(chat, temperature=0.7)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.set_defaults(func=cmd_chat)
    serve = sub.add_parser("serve", help="the websocket gateway and chat page over the actor runtime")
    add_engine_args(serve)
    from cadenza.gateway.server import add_serve_args

    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)
    bench = sub.add_parser("bench", help="benchmarks printing JSON")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    offline = bench_sub.add_parser("offline", help="offline throughput, TTFT/TPOT and the machine's limits")
    add_engine_args(offline)
    from cadenza.benchmarks.offline import add_offline_args

    add_offline_args(offline)
    offline.set_defaults(func=cmd_bench_offline)
    moe_help = "a tiny Mixtral against all its experts and a dense model of its active size"
    moe = bench_sub.add_parser("moe", help=moe_help)
    from cadenza.benchmarks.moe import add_moe_args

    add_moe_args(moe)
    moe.set_defaults(func=cmd_bench_moe)
    actors = bench_sub.add_parser("actors", help="decode step time through the actors vs in-process")
    actors.add_argument("--model", default=DEFAULT_MODEL)
    actors.add_argument("--num-blocks", type=int, default=512)
    from cadenza.benchmarks.actors import add_actor_args

    add_actor_args(actors)
    actors.set_defaults(func=cmd_bench_actors)
    serve_bench = bench_sub.add_parser("serve", help="TTFT / ITL / TPOT and throughput of a running server")
    from cadenza.benchmarks.serve import add_serve_bench_args

    add_serve_bench_args(serve_bench)
    serve_bench.set_defaults(func=cmd_bench_serve)
    spec = bench_sub.add_parser("spec", help="single-stream decode with n-gram / draft-model speculation vs none")
    add_engine_args(spec)
    from cadenza.benchmarks.spec import add_spec_args

    add_spec_args(spec)
    spec.set_defaults(func=cmd_bench_spec)
    formats = bench_sub.add_parser("formats", help="one model in each weight format: decode, TTFT, batch, bytes")
    from cadenza.benchmarks.formats import add_formats_args

    add_formats_args(formats)
    formats.set_defaults(func=cmd_bench_formats)
    structured = bench_sub.add_parser("structured", help="what a JSON-schema grammar costs per token, overlap on/off")
    from cadenza.benchmarks.structured import add_structured_args

    add_structured_args(structured)
    structured.set_defaults(func=cmd_bench_structured)
    moved = bench_sub.add_parser("moved-session", help="a moved conversation's TTFT: cached, recomputed, KV pulled")
    from cadenza.benchmarks.moved_session import add_moved_session_args

    add_moved_session_args(moved)
    moved.set_defaults(func=cmd_bench_moved_session)
    shared_help = "conversations over shared documents on two replicas: KV pulls vs session affinity alone"
    shared = bench_sub.add_parser("shared-document", help=shared_help)
    from cadenza.benchmarks.shared_document import add_shared_document_args

    add_shared_document_args(shared)
    shared.set_defaults(func=cmd_bench_shared_document)
    log_help = "the shared response log's cost per event under Serve: append to acknowledgement"
    shared_log = bench_sub.add_parser("shared-log", help=log_help)
    from cadenza.benchmarks.shared_log import add_shared_log_args

    add_shared_log_args(shared_log)
    shared_log.set_defaults(func=cmd_bench_shared_log)
    gpu = sub.add_parser("gpu-check", help="every Triton kernel and the whole model on CUDA, against torch (JSON)")
    from cadenza.benchmarks.gpu_check_args import add_gpu_check_args

    add_gpu_check_args(gpu)
    gpu.set_defaults(func=cmd_gpu_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    apply_hub_flags(args)
    warn_ignored(args)
    try:
        _resolve_model(args)
        return args.func(args)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"cadenza: error: {e}", file=sys.stderr)
        return 2
    except ConnectionError as e:  # a named Ray cluster that does not answer (actors/local_ray.py)
        print(f"cadenza: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
