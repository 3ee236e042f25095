"""Ray Serve: the deploy files validate, and two replicas serve HTTP, the openai websocket and
a plain websocket, with session-affine routing and engine-death recovery."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
import websockets
import yaml
from cadenza_testkit.waiting import until_sync

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_serve_config_validates_and_the_kuberay_manifest_embeds_it() -> None:
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    assert app.import_path == "cadenza.gateway.serve_app:build_app"
    deployment = app.deployments[0]
    assert deployment.autoscaling_config["min_replicas"] == 1
    manifest = yaml.safe_load((DEPLOY / "kuberay-rayservice.yaml").read_text())
    assert manifest["kind"] == "RayService"
    embedded = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(embedded)
    assert embedded["applications"] == config["applications"]
    assert embedded["http_options"]["host"] == "0.0.0.0" and config["http_options"]["host"] == "127.0.0.1"
    gpu = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert gpu["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # The app builder refuses what it does not know.
    from cadenza.gateway.serve_app import build_app

    with pytest.raises(ValueError, match="unknown gateway settings"):
        build_app({"gateway": {"max_frame_size": 1}})


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cadenza_testkit.tiny_models import build_tiny_chat_model

    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))


@pytest.fixture(scope="module")
def two_replicas(ray_cluster, tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """Two replicas on two Ray nodes (a second raylet joined on loopback): every test here, KV
    pulls and the shared response log included, crosses nodes."""
    from cadenza_testkit.ray_nodes import second_node
    from cadenza_testkit.servers import free_port

    with second_node(4, tmp_path_factory.mktemp("ray_node") / "ray_start.log"):
        yield from _two_replicas(tiny_chat_model, free_port())


def _two_replicas(tiny_chat_model: Path, port: int):  # noqa: ANN202 - the fixture's generator
    from ray import serve

    from cadenza.gateway.serve_app import SESSION_ROUTER, CadenzaDeployment

    # One proxy: a second one, on the second node's (same) address, could not bind the port.
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    app = CadenzaDeployment.options(
        num_replicas=2,
        max_replicas_per_node=1,
        request_router_config=SESSION_ROUTER,
        health_check_period_s=1,
        health_check_timeout_s=10,
    ).bind(
        str(tiny_chat_model),
        "tiny",
        {"num_blocks": 256, "max_engine_restarts": 1, "kv_transport": "nixl"},  # KV pulls cross nodes by NIXL
        {"metrics_push_interval_s": 0.5, "response_owner_timeout_s": 2.0, "response_log_flush_s": 0.2},
    )
    serve.run(app, name="cadenza", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def _get(url: str, headers: dict | None = None) -> tuple[str, dict]:
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        return r.headers["x-cadenza-replica"], json.loads(r.read())


@pytest.mark.slow
def test_two_replicas_serve_http_and_websockets_with_session_affinity(two_replicas: str) -> None:
    client = openai.OpenAI(base_url=two_replicas + "/v1", api_key="none")
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=6, stream=True
    )
    assert sum(1 for c in stream if c.choices and c.choices[0].delta.content is not None) >= 1

    async def over_websockets() -> tuple[str, str]:
        async with openai.AsyncOpenAI(base_url=two_replicas + "/v1", api_key="none").responses.connect() as conn:
            await conn.response.create(model="tiny", input="hello", max_output_tokens=5)
            async for ev in conn:
                if ev.type in ("response.completed", "response.incomplete"):
                    sdk = ev.response.status
                    break
        async with websockets.connect(two_replicas.replace("http", "ws") + "/v1/responses") as ws:
            await ws.send(json.dumps({"type": "response.create", "input": "hi", "max_output_tokens": 3}))
            while (ev := json.loads(await ws.recv()))["type"] not in ("response.completed", "response.incomplete"):
                pass
            return sdk, ev["response"]["status"]

    assert asyncio.run(over_websockets()) == ("incomplete", "incomplete")  # max_output_tokens reached

    alice = {_get(two_replicas, {"x-session-id": "alice"})[0] for _ in range(6)}
    assert len(alice) == 1  # one session, one replica
    answers = [_answer(two_replicas, f"user-{i}") for i in range(8)]
    spread = {replica for replica, _ in answers}
    assert len(spread) == 2 and len({node for _, node in answers}) == 2  # both replicas, one per node
    # /metrics, whichever replica answers, holds both replicas' requests, each labelled.
    until_sync(lambda: _replicas_in_metrics(two_replicas) == spread, "both replicas in one scrape")
    # And through Ray's metrics export, as a cluster's Prometheus scrapes every node: each
    # replica's samples, tagged with its replica.
    deadline = time.monotonic() + 90  # Ray's agents report every metrics_report_interval_ms
    while not _exported_for(spread):
        assert time.monotonic() < deadline, "both replicas not in Ray's metrics export"
        time.sleep(1)


def _exported_for(replicas: set[str]) -> bool:
    import ray

    text = ""
    for node in ray.nodes():
        if node["Alive"]:
            url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
            with urllib.request.urlopen(url, timeout=30) as r:
                text += r.read().decode()
    lines = [line for line in text.splitlines() if line.startswith("ray_cadenza_request_success_total{")]
    tagged = {line.split('replica="', 1)[1].split('"', 1)[0] for line in lines if 'replica="' in line}
    return all(any(replica in tag for tag in tagged) for replica in replicas)


def _answer(url: str, session: str) -> tuple[str, str]:
    """The replica and the Ray node that answer a chat request of `session`."""
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    headers = {"Content-Type": "application/json", "x-session-id": session}
    with urllib.request.urlopen(urllib.request.Request(url + "/v1/chat/completions", body, headers), timeout=60) as r:
        return r.headers["x-cadenza-replica"], r.headers["x-cadenza-node"]


def _replicas_in_metrics(url: str) -> set[str]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    lines = [line for line in text.splitlines() if line.startswith("cadenza:request_success_total{")]
    return {line.split('replica="', 1)[1].split('"', 1)[0] for line in lines}


@pytest.mark.slow
def test_a_moved_session_continues_with_its_kv_pulled_from_the_old_replica(two_replicas: str) -> None:
    """The conversation store and the KV directory are shared: a turn the router sends to the
    other replica finds its history there and pulls its prefix KV from the replica that
    computed it (gateway/peer_kv.py; across nodes by NIXL, read straight out of the other
    replica's registered caches), then answers the same greedy tokens as at home."""
    client = openai.OpenAI(base_url=two_replicas + "/v1", api_key="none")
    ask = dict(model="tiny", max_output_tokens=8, temperature=0)
    document = "My name is Ada and I keep the lighthouse on the northern cape. " * 12
    raw = client.responses.with_raw_response.create(input=document, extra_headers={"x-session-id": "ada"}, **ask)
    home, first = raw.headers["x-cadenza-replica"], raw.parse()
    assert first.usage.input_tokens >= 128
    follow = dict(input="What is my name?", previous_response_id=first.id, **ask)
    for i in range(20):  # new session ids go to the replica home to fewer sessions: soon the other
        raw = client.responses.with_raw_response.create(extra_headers={"x-session-id": f"moved-{i}"}, **follow)
        if raw.headers["x-cadenza-replica"] != home:
            break
    assert raw.headers["x-cadenza-replica"] != home
    moved = raw.parse()
    assert moved.previous_response_id == first.id and moved.usage.input_tokens > first.usage.input_tokens
    # The first turn's full blocks came across: its prompt's, at least (the output's last
    # block may be partial, and the last prompt token always runs).
    assert moved.usage.input_tokens_details.cached_tokens >= (first.usage.input_tokens // 16) * 16
    raw = client.responses.with_raw_response.create(extra_headers={"x-session-id": "ada"}, **follow)
    assert raw.headers["x-cadenza-replica"] == home
    assert moved.output_text == raw.parse().output_text  # the same greedy tokens as unmoved
    replica, stats = _stats(two_replicas, f"moved-{i}")
    pulls = stats["engine"]["kv_transfer"]
    assert replica != home and pulls["num_handoffs"] >= 1 and pulls["num_blocks_imported"] > 0
    assert pulls["num_blocks_pulled"] == pulls["num_blocks_imported"]  # two Ray nodes, and NIXL reads across


@pytest.mark.slow
def test_a_new_conversation_on_a_shared_document_starts_from_the_other_replicas_kv(two_replicas: str) -> None:
    """Without the session, the router cannot know where a prompt's prefix is cached; the
    replica it lands on asks the KV directory and pulls it."""
    document = "The keeper logs the wind, the tide and every passing ship in the ledger. " * 10
    turn = lambda question: [{"role": "system", "content": document}, {"role": "user", "content": question}]  # noqa: E731
    home, first = _chat(two_replicas, turn("Who keeps the ledger?"), "reader-0")
    for i in range(1, 20):  # new session ids go to the replica home to fewer sessions: soon the other
        replica, other = _chat(two_replicas, turn(f"What is logged, question {i}?"), f"reader-{i}")
        if replica != home:
            break
    assert replica != home
    shared = (first["usage"]["prompt_tokens"] - 24) // 16 * 16  # the document's blocks, before the question
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] >= shared > 0


def _chat(url: str, messages: list[dict], session: str) -> tuple[str, dict]:
    body = json.dumps({"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0}).encode()
    headers = {"Content-Type": "application/json", "x-session-id": session}
    with urllib.request.urlopen(urllib.request.Request(url + "/v1/chat/completions", body, headers), timeout=60) as r:
        return r.headers["x-cadenza-replica"], json.loads(r.read())


def _stats(url: str, session: str) -> tuple[str, dict]:
    request = urllib.request.Request(url + "/stats", headers={"x-session-id": session})
    with urllib.request.urlopen(request, timeout=60) as r:
        return r.headers["x-cadenza-replica"], json.loads(r.read())


def _restarted_engine(url: str, session: str, replica: str, old_pid: int) -> dict:
    """The stats of `replica` once its AsyncLLM has replaced the engine actor `old_pid`."""
    deadline = time.monotonic() + 120
    while True:
        assert time.monotonic() < deadline, "the replica did not restart its dead engine"
        try:
            seen, stats = _stats(url, session)
        except OSError:  # the dying engine's last calls fail; that is expected
            seen, stats = None, {}
        if seen == replica and stats["engine"]["engine_pid"] != old_pid:
            return stats
        time.sleep(0.5)


@pytest.mark.slow
def test_a_dead_engine_is_restarted_in_place_then_serve_replaces_the_replica(two_replicas: str) -> None:
    """The replica's AsyncLLM replaces a dead engine up to max_engine_restarts (1 here); the next
    death fails its health check and Serve replaces the replica."""
    victim, stats = _stats(two_replicas, "victim")
    os.kill(stats["engine"]["engine_pid"], signal.SIGKILL)
    stats = _restarted_engine(two_replicas, "victim", victim, stats["engine"]["engine_pid"])
    assert stats["engine"]["num_engine_restarts"] == 1
    assert _get(two_replicas, {"x-session-id": "victim"})[1]["choices"][0]["message"]["content"] is not None
    os.kill(stats["engine"]["engine_pid"], signal.SIGKILL)
    deadline, seen = time.monotonic() + 120, set()
    while not (len(seen) == 2 and victim not in seen):  # Serve replaces the unhealthy replica
        assert time.monotonic() < deadline, f"the replica with the dead engine was not replaced: {seen}"
        seen = set()
        for i in range(8):
            try:
                seen.add(_get(two_replicas, {"x-session-id": f"probe-{time.monotonic()}-{i}"})[0])
            except OSError:  # requests that reached the dying replica fail; that is expected
                pass
        time.sleep(1)
    for i in range(6):
        _, body = _get(two_replicas, {"x-session-id": f"after-{i}"})
        assert body["choices"][0]["message"]["content"] is not None


def test_the_disaggregated_serve_config_validates_and_builds() -> None:
    from ray.serve.schema import ServeDeploySchema

    from cadenza.gateway.serve_app import build_app

    config = yaml.safe_load((DEPLOY / "serve_config_pd.yaml").read_text())
    (app,) = ServeDeploySchema.model_validate(config).applications
    assert app.args["disaggregation"] == "1P1D"
    build_app(app.args)  # the app builds: every arg known, the spec parses
    with pytest.raises(ValueError, match="disaggregation must look like 1P1D"):
        build_app({**app.args, "disaggregation": "1P"})


@pytest.mark.slow
def test_a_disaggregated_replica_serves_beside_the_others(two_replicas: str, tiny_chat_model: Path) -> None:
    """One replica holding a prefill and a decode engine, as serve_config_pd.yaml deploys it."""
    from ray import serve

    from cadenza.gateway.serve_app import CadenzaDeployment

    engine = {"num_blocks": 128, "max_local_prefill_tokens": 0}  # the short prompt is handed over too
    app = CadenzaDeployment.options(name="CadenzaPD", num_replicas=1).bind(
        str(tiny_chat_model), "tiny", engine, {}, "1P1D"
    )
    serve.run(app, name="cadenza-pd", route_prefix="/pd")
    try:
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hello " * 20}], "max_tokens": 4})
        request = urllib.request.Request(
            two_replicas + "/pd/v1/chat/completions", body.encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 4
        with urllib.request.urlopen(two_replicas + "/pd/stats", timeout=60) as r:
            stats = json.loads(r.read())["engine"]
        assert [role for role, _ in stats["roles"]] == ["prefill", "decode"]
        assert stats["kv_transfer"]["num_handoffs"] == 1 and stats["kv_transfer"]["num_blocks_imported"] > 0
    finally:
        serve.delete("cadenza-pd")


def _post(url: str, body: dict, session: str) -> urllib.request.Request:
    headers = {"Content-Type": "application/json", "x-session-id": session}
    return urllib.request.Request(url + "/v1/responses", json.dumps(body).encode(), headers)


def _sse(response: Any, limit: int | None = None) -> list[dict]:  # noqa: ANN401 - an HTTP response
    events = []
    for line in response:
        if line.startswith(b"data: "):
            events.append(json.loads(line[6:]))
            if len(events) == limit:
                break
    return events


def _resume(url: str, rid: str, after: int) -> list[dict]:
    """The response's events after `after`, from whichever replica answers (the dead one's
    requests fail until Serve stops routing to it)."""
    deadline = time.monotonic() + 120
    while True:
        assert time.monotonic() < deadline, "no replica resumed the response"
        query = f"/v1/responses/{rid}?stream=true&starting_after={after}"
        request = urllib.request.Request(url + query, headers={"x-session-id": f"resume-{time.monotonic()}"})
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                return _sse(r)
        except OSError:
            time.sleep(0.5)


def _cut_and_resumed(url: str, body: dict, session: str) -> list[dict]:
    """`body` streamed in the background from `session`'s replica, which is SIGKILLed after 12
    events; then every event, resumed through the proxy from whichever replica answers."""
    victim, stats = _stats(url, session)
    streamed = {**body, "stream": True, "background": True}
    with urllib.request.urlopen(_post(url, streamed, session), timeout=120) as r:
        assert r.headers["x-cadenza-replica"] == victim  # the session's replica runs it
        seen = _sse(r, limit=12)
        os.kill(stats["gateway"]["gateway_pid"], signal.SIGKILL)
    assert seen[-1]["type"] == "response.output_text.delta"  # cut mid-stream
    return seen + _resume(url, seen[0]["response"]["id"], len(seen) - 1)


@pytest.mark.slow
def test_a_streamed_response_survives_the_sigkill_of_its_replica(two_replicas: str) -> None:
    """The replica running a streamed greedy response is SIGKILLed mid-stream: the client resumes
    through the proxy, a survivor re-issues the response from the shared log, and the resumed
    stream equals the uncut reference, no event missing or repeated."""
    import ray

    from cadenza.gateway.shared_log import log_name

    body = {"model": "tiny", "input": "tell me a long story", "max_output_tokens": 300, "temperature": 0}
    with urllib.request.urlopen(_post(two_replicas, body, "reference"), timeout=120) as r:
        reference = json.loads(r.read())
    uncut = reference["output"][0]["content"][0]["text"]
    name = log_name("cadenza", "tiny")
    (where,) = [a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == name]
    log = ray.get_actor(name, namespace=where)
    for attempt in range(3):
        events = _cut_and_resumed(two_replicas, body, f"doomed-{attempt}")
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert events[-1]["type"] == reference_terminal(reference) and text == uncut
        if ray.get(log.stats.remote())["reissued"] >= 1:
            break
        # The replica finished the response (a loaded host kept the client from its first
        # events that long) and the log replayed it whole: right, but no re-issue. Again.
    # The shared log says so: the response was re-issued, not merely replayed.
    assert ray.get(log.stats.remote())["reissued"] >= 1


def reference_terminal(response: dict) -> str:
    return "response.completed" if response["status"] == "completed" else "response.incomplete"
