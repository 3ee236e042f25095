"""Ray Serve deployment: the gateway app and its engine, replicated.

Replica shape: each replica owns its engine (an AsyncLLM: engine actor + worker actors),
created in the replica's constructor, and serves the same ASGI app as `cadenza serve`.
Why not a separate engine deployment: a conversation's state lives in two places, the
gateway's response store and the engine's prefix cache, and both must be on the replica
the session router sends the conversation to; one replica = one gateway + one engine
keeps them together, and there is no extra hop per token. Serve's health check calls the
engine: a dead engine is restarted in place (up to max_engine_restarts), and once the
restarts are spent the failing health check gets the replica replaced.

API key: `gateway.api_key` in the config, or, when that is absent (or null), the environment
variable CADENZA_API_KEY of the replica's process (deploy/kuberay-rayservice.yaml sets it from
a Kubernetes Secret on every Ray container). Read in the replica, not in build_app, so the key
is not pickled into the deployment's arguments, which the Serve controller keeps in the GCS.
Set but blank, it is an error (the replica fails to start) rather than serving without a key.

    serve run deploy/serve_config.yaml      # or: serve.run(build_app({...}))
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from starlette.types import ASGIApp, Receive, Scope, Send

from cadenza.actors.async_llm import AsyncLLM
from cadenza.actors.disaggregated import DisaggregatedLLM, parse_disaggregation
from cadenza.config import DEFAULT_MODEL
from cadenza.gateway.app import build_app as build_gateway
from cadenza.gateway.autoscaling import KV_USAGE, RUNNING, WAITING
from cadenza.gateway.kv_directory import KVDirectory, directory_name
from cadenza.gateway.mirrored_logs import MirroredLogs, SharedLogClient
from cadenza.gateway.peer_kv import PeerKVEngine
from cadenza.gateway.replica_metrics import MetricsBoard, board_name
from cadenza.gateway.settings import GatewaySettings
from cadenza.gateway.shared_log import log_name
from cadenza.gateway.shared_store import SharedStore, store_name

REPLICA_HEADER = "x-cadenza-replica"
NODE_HEADER = "x-cadenza-node"  # the Ray node the replica runs on
API_KEY_ENV = "CADENZA_API_KEY"
SESSION_ROUTER = RequestRouterConfig(request_router_class="cadenza.gateway.serve_router:SessionAffinityRouter")


@serve.deployment(name="Cadenza")
@serve.ingress()
class CadenzaDeployment:
    def __init__(
        self,
        model: str,
        served_model_name: str | None,
        engine: dict[str, Any],
        gateway: dict[str, Any],
        disaggregation: str | None = None,
    ) -> None:
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.app_name = context.app_name
        self.model_name = served_model_name or model
        self.settings = GatewaySettings(**gateway_with_env_key(gateway))
        # With disaggregation ("1P1D", ...) the replica's engine is that many prefill and decode
        # engines (actors/disaggregated.py), served as one.
        s = self.settings
        # A prompt starts from KV another replica cached, pulled across (gateway/peer_kv.py):
        # replicas on one node share their caches for it (kv_transport "auto").
        pulls = not disaggregation and s.kv_pull_min_tokens > 0 and engine.get("enable_prefix_caching") is not False
        if pulls and engine.get("kv_transport", "auto") == "auto":
            engine = {**engine, "kv_transport": "ipc"}
        llm = DisaggregatedLLM(model, disaggregation, **engine) if disaggregation else AsyncLLM(model, **engine)
        self.directory: KVDirectory | None = None
        if pulls:
            self.directory = KVDirectory(directory_name(self.app_name, self.model_name))
            llm = PeerKVEngine(llm, self.directory, self.replica_id, s.kv_pull_min_tokens, s.kv_pull_timeout_s)
        self.engine = llm

    def __serve_build_asgi_app__(self) -> ASGIApp:
        # The Host check is on only where gateway.allowed_hosts names the hosts: clients reach
        # Serve's proxy by whatever name the cluster (Service, Ingress) gives it, unknown here.
        check_host = bool(self.settings.allowed_hosts)
        # One conversation store for every replica of this application: a session the router
        # moves still finds its history (its prefix KV is recomputed where it lands).
        s = self.settings
        name = store_name(self.app_name, self.model_name)
        store = SharedStore(s.response_store_size, s.response_store_ttl_s, s.response_store_max_bytes, name)
        # /metrics on any replica answers for all of them (gateway/replica_metrics.py).
        name = board_name(self.app_name, self.model_name)
        self.board = MetricsBoard(name, self.replica_id, s.metrics_push_interval_s)
        # Every response's events in one log: read and cancelled from any replica, re-issued on a
        # survivor when its replica dies (gateway/shared_log.py).
        name = log_name(self.app_name, self.model_name)
        client = SharedLogClient(name, s.response_log_bounds, s.response_owner_timeout_s)
        self.logs = MirroredLogs(s.response_log_bounds, client, self.replica_id, s.response_log_flush_s)
        app = build_gateway(
            self.engine, self.model_name, self.settings, check_host=check_host, store=store,
            metrics_board=self.board, logs=self.logs,
        )  # fmt: skip
        return _ReplicaHeader(app, self.replica_id, ray.get_runtime_context().get_node_id())

    async def check_health(self) -> None:
        """Serve calls this every health_check_period_s; raising gets the replica replaced."""
        if getattr(self, "board", None) is not None:
            self.board.start()  # the first check comes as the replica starts: post from then on
            self.logs.start()
        await self.engine.check_health()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics (gateway/autoscaling.py), about once a second."""
        engine = (await self.engine.stats()).engine
        pool = engine.kv_cache
        in_use = (pool.num_blocks - pool.num_free_blocks - engine.num_pinned_blocks) / max(pool.num_blocks, 1)
        return {RUNNING: engine.num_running, WAITING: engine.num_waiting, KV_USAGE: max(in_use, 0.0)}

    def __del__(self) -> None:
        logs = getattr(self, "logs", None)
        if logs is not None:  # its unfinished responses go to the survivors now, not at the lease's end
            logs.client.leave(self.replica_id)
        engine = getattr(self, "engine", None)
        if isinstance(engine, PeerKVEngine):  # out of the KV directory, its conversations' KV to a survivor
            engine.hand_over()
        if engine is not None:
            engine.shutdown()


def gateway_with_env_key(gateway: dict[str, Any]) -> dict[str, Any]:
    """The gateway settings with api_key from $CADENZA_API_KEY when the config gives none."""
    if gateway.get("api_key") is None and (key := os.environ.get(API_KEY_ENV)) is not None:
        return {**gateway, "api_key": key}
    return gateway


class _ReplicaHeader:
    """Names the replica and its Ray node in every HTTP response (and websocket handshake), as
    x-cadenza-replica and x-cadenza-node."""

    def __init__(self, app: ASGIApp, replica_id: str, node_id: str) -> None:
        self.app = app
        self.headers = [(REPLICA_HEADER.encode(), replica_id.encode()), (NODE_HEADER.encode(), node_id.encode())]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def tagged(message: dict) -> None:
            if message["type"] in ("http.response.start", "websocket.accept"):
                message = {**message, "headers": [*message.get("headers", []), *self.headers]}
            await send(message)

        await self.app(scope, receive, tagged if scope["type"] in ("http", "websocket") else send)


def build_app(args: dict[str, Any]) -> serve.Application:
    """Serve app builder (`import_path: cadenza.gateway.serve_app:build_app`); `args` from the
    YAML: model, served_model_name, engine (EngineConfig fields), gateway (GatewaySettings
    fields, host/port excepted: Serve's proxy listens), disaggregation ("1P1D": each replica
    runs that many prefill and decode engines; deploy/serve_config_pd.yaml)."""
    known = {"model", "served_model_name", "engine", "gateway", "disaggregation"}
    if unknown := set(args) - known:
        raise ValueError(f"unknown Cadenza app args {sorted(unknown)}; expected {sorted(known)}")
    gateway = dict(args.get("gateway") or {})
    fields = {f.name for f in dataclasses.fields(GatewaySettings)} - {"host", "port"}
    if bad := set(gateway) - fields:
        raise ValueError(f"unknown gateway settings {sorted(bad)}; expected some of {sorted(fields)}")
    disaggregation = args.get("disaggregation")
    if disaggregation:
        parse_disaggregation(disaggregation)  # a bad spec fails the deploy, not each replica
    return CadenzaDeployment.options(request_router_config=SESSION_ROUTER).bind(
        args.get("model", DEFAULT_MODEL), args.get("served_model_name"), dict(args.get("engine") or {}), gateway,
        disaggregation,
    )  # fmt: skip
