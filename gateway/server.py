"""`cadenza serve`: an AsyncLLM engine behind the gateway app, on uvicorn with uvloop and the
`websockets` protocol implementation."""

from __future__ import annotations

import argparse
import dataclasses
import logging

from cadenza.gateway.app import build_app
from cadenza.gateway.settings import GatewaySettings

from cadenza.engine_args import engine_kwargs

log = logging.getLogger(__name__)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--served-model-name", default=None, help="the name clients send as `model` (default: --model)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", type=int, default=1)
    p.add_argument("--num-blocks", type=int, default=None)
    defaults = GatewaySettings()
    for f in dataclasses.fields(GatewaySettings):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if f.name == "allowed_origins":
            p.add_argument(flag, nargs="*", default=[], help="Origins allowed on websockets (default: our own)")
        elif f.name == "api_key":
            p.add_argument(flag, default=None, help="require `Authorization: Bearer <key>`")
        elif isinstance(default, bool):  # type=bool would read "--flag False" as True
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            p.add_argument(flag, type=type(default), default=default)


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(GatewaySettings)}
    values["allowed_origins"] = tuple(values["allowed_origins"])
    return GatewaySettings(**values)


def run_server(args: argparse.Namespace) -> None:
    import uvicorn

    from cadenza.async_llm import AsyncLLM

    settings = settings_from_args(args)
    engine = AsyncLLM(
        args.model,
        **engine_kwargs(args),
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        num_blocks=args.num_blocks,
    )
    app = build_app(engine, args.served_model_name or args.model, settings)
    print(f"cadenza: serving {args.model} on http://{settings.host}:{settings.port}/", flush=True)
    try:
        uvicorn.run(
            app,
            host=settings.host,
            port=settings.port,
            loop="uvloop",
            ws="websockets-sansio",
            # Frames up to 4x the limit reach the app, which answers with an `error` event.
            ws_max_size=4 * settings.max_frame_bytes,
            log_level="warning",
        )
    finally:
        engine.shutdown()
