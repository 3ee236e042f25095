"""`cadenza serve`: an AsyncLLM engine behind the gateway app, on uvicorn with uvloop and the
`websockets` protocol implementation; SIGTERM (or Ctrl-C) drains it, then it exits 0."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
from types import FrameType

import uvicorn
from starlette.applications import Starlette

from cadenza.engine_args import engine_kwargs
from cadenza.engine_client import EngineClient
from cadenza.gateway.app import build_app
from cadenza.gateway.connection_deadlines import deadline_protocol
from cadenza.gateway.log_format import configure_logging
from cadenza.gateway.settings import GatewaySettings
from cadenza.gateway.state import GatewayState
from cadenza.setting import add_flags, values_from_args
from cadenza.vllm_flags import add_ignored_flags

log = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 5


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--served-model-name", default=None, help="the name clients send as `model` (default: --model)")
    p.add_argument("model_tag", nargs="?", default=None, help="the model, as vLLM takes it (the same as --model)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file (or text) in place of the model's")
    add_ignored_flags(p)
    p.add_argument(
        "--disaggregation",
        default=None,
        help="prefill/decode disaggregation: NPMD, N prefill and M decode engines (e.g. 1P1D); default: one engine",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="step the engine in the server's own process, without Ray (one worker: TP = PP = 1)",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="the Ray cluster to join (GCS host:port, auto, ray://host:port; default $RAY_ADDRESS); "
        "none named: a private instance on loopback",
    )
    add_flags(p, GatewaySettings)


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    return GatewaySettings(**values_from_args(args, GatewaySettings))


def run_server(args: argparse.Namespace) -> None:
    settings = settings_from_args(args)  # first: a bad flag is one line, before any engine loads
    configure_logging(settings.log_level, settings.log_format)

    engine = _engine_client(args)
    if args.chat_template:
        engine.get_tokenizer().chat_template = _template_text(args.chat_template)
    app = build_app(engine, args.served_model_name or args.model, settings)
    print(f"cadenza: serving {args.model} on http://{settings.host}:{settings.port}/", flush=True)
    try:
        serve(app, settings)
    finally:
        engine.shutdown()


def _template_text(given: str) -> str:
    """--chat-template as vLLM takes it: a file's path, or the template itself."""
    if os.path.isfile(given):
        with open(given, encoding="utf-8") as f:
            return f.read()
    if "{" not in given:
        raise ValueError(f"--chat-template {given!r}: no such file, and not a Jinja template")
    return given


def _engine_client(args: argparse.Namespace) -> EngineClient:
    """The engine behind the gateway: actors (AsyncLLM) unless --in-process; imported late, so a
    bad flag is reported before Ray or torch loads."""
    kwargs = engine_kwargs(args)
    if args.in_process:
        from cadenza.actors.inprocess_client import InProcessClient

        return InProcessClient(args.model, **kwargs)
    if args.disaggregation:
        if args.in_process:
            raise ValueError("--disaggregation runs engines as Ray actors: not with --in-process")
        from cadenza.actors.disaggregated import DisaggregatedLLM

        llm = DisaggregatedLLM(args.model, args.disaggregation, ray_address=args.ray_address, **kwargs)
        print(f"cadenza: {args.disaggregation} engines on {llm.ray_instance}", flush=True)
        return llm
    from cadenza.actors.async_llm import AsyncLLM

    llm = AsyncLLM(args.model, ray_address=args.ray_address, **kwargs)
    print(f"cadenza: engine on {llm.ray_instance}", flush=True)
    return llm


def uvicorn_config(app: Starlette, settings: GatewaySettings) -> uvicorn.Config:
    """The one uvicorn configuration, shared by `cadenza serve` and the tests."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=deadline_protocol(settings.header_timeout_s, settings.send_timeout_s),
        ws="websockets-sansio",
        # Frames up to 4x the limit reach the app, which answers with an `error` event.
        ws_max_size=4 * settings.max_frame_bytes,
        limit_concurrency=settings.max_connections,
        # uvicorn trusts X-Forwarded-For from 127.0.0.1 by default: only from named proxies here.
        proxy_headers=bool(settings.forwarded_allow_ips),
        forwarded_allow_ips=list(settings.forwarded_allow_ips) or None,
        timeout_keep_alive=settings.idle_timeout_s,
        # After the drain: a connection still open this long is cut rather than waited for.
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        log_level=settings.uvicorn_log_level,
    )


class GatewayServer(uvicorn.Server):
    """uvicorn that drains the gateway (drain.Drain.run) before it closes any connection.
    The listener stays open meanwhile, so a client that still arrives hears 503 and why,
    rather than a refused connection."""

    def __init__(self, config: uvicorn.Config, state: GatewayState) -> None:
        super().__init__(config)
        self.state = state

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self.state.drain.run(self.state.settings.drain_timeout_s)
        await super().shutdown(sockets)


def serve(app: Starlette, settings: GatewaySettings) -> None:
    """Runs the app until SIGTERM or Ctrl-C, then drains it and returns."""
    # uvicorn re-raises the signal it stopped on once it is done, to whatever handler was
    # there before; with the default one SIGTERM would end the process with 143, after a drain
    # that has already handled it. (Installed only now: Ctrl-C while the engine loads still stops it.)
    previous = {sig: signal.signal(sig, _handled) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        GatewayServer(uvicorn_config(app, settings), app.state.gateway).run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _handled(signum: int, frame: FrameType | None) -> None:
    log.info("signal %d: the server has drained and stopped", signum)
