"""Serve autoscaling on the engines' signals (gateway/autoscaling.py), driven under load: one
replica becomes two while clients keep the engines busy, and one again when the load falls,
with every request answered; the replica Serve stops hands its conversations' KV to the one
that stays (gateway/peer_kv.py), so their next turns start from KV there."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request

import openai
import pytest
from cadenza_testkit.waiting import until_sync

from cadenza.gateway.kv_directory import KVDirectory, directory_name

pytestmark = pytest.mark.slow

POLICY = "cadenza.gateway.autoscaling:engine_load_policy"
ASK = dict(model="tiny", max_output_tokens=4, temperature=0)


def _running_replicas(app: str) -> int:
    from ray import serve

    deployment = serve.status().applications[app].deployments["CadenzaAuto"]
    return deployment.replica_states.get("RUNNING", 0)


def _ask(url: str, i: int) -> tuple[int, str]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"count to {i}"}], "max_tokens": 48,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=120) as r:
        return r.status, r.headers["x-cadenza-replica"]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none")


def _a_conversation_on_each_replica(url: str) -> list:
    """First turns (Responses API, so their KV is pinned as a conversation's), one per replica."""
    firsts: dict[str, object] = {}
    for i in range(20):  # new session ids go to the replica home to fewer sessions
        text = f"Conversation {i}: the keeper counts the ships that pass the cape at night. " * 8
        session = {"x-session-id": f"d{i}"}
        raw = _client(url).responses.with_raw_response.create(input=text, extra_headers=session, **ASK)
        firsts.setdefault(raw.headers["x-cadenza-replica"], raw.parse())
        if len(firsts) == 2:
            return list(firsts.values())
    raise AssertionError(f"conversations reached {len(firsts)} replica(s) only")


def test_engine_load_scales_one_replica_to_two_and_back(ray_cluster, tmp_path_factory: pytest.TempPathFactory) -> None:  # noqa: ANN001
    from cadenza_testkit.servers import free_port
    from cadenza_testkit.tiny_models import build_tiny_chat_model
    from ray import serve

    from cadenza.gateway.serve_app import SESSION_ROUTER, CadenzaDeployment

    path = build_tiny_chat_model(tmp_path_factory.mktemp("autoscale"))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    autoscaling = {
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2, "upscale_delay_s": 0.5,
        "downscale_delay_s": 2.0, "metrics_interval_s": 0.5, "look_back_period_s": 1.0,
        "policy": {"policy_function": POLICY},
    }  # fmt: skip
    options = dict(name="CadenzaAuto", autoscaling_config=autoscaling, request_router_config=SESSION_ROUTER)
    serve.run(CadenzaDeployment.options(**options).bind(str(path), "tiny", {"num_blocks": 512}, {}), name="auto")
    url, answers, errors, clients = f"http://127.0.0.1:{port}", [], [], 8
    stop = [threading.Event() for _ in range(clients)]

    def client(k: int) -> None:
        i = 0
        while not stop[k].is_set():
            try:
                answers.append(_ask(url, i))
            except Exception as e:  # an HTTP error status or a dropped connection: a lost request
                errors.append(repr(e))
            i += 1

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    try:
        assert _running_replicas("auto") == 1
        for t in threads:
            t.start()
        until_sync(lambda: _running_replicas("auto") == 2, "scaled out to 2 replicas under load", 120)
        seen = len(answers)
        until_sync(lambda: len({r for _, r in answers[seen:]}) == 2, "both replicas answering", 60)
        firsts = _a_conversation_on_each_replica(url)
        for event in stop[1:]:  # one client stays: below one replica's target, still under load
            event.set()
        until_sync(lambda: _running_replicas("auto") == 1, "scaled back to 1 replica", 120)
        directory = KVDirectory(directory_name("auto", "tiny"))
        until_sync(lambda: asyncio.run(directory.recent_hand_overs()), "the stopped replica handed over", 60)
        for first in firsts:  # whichever replica stopped, its conversation's KV is on the survivor
            turn = _client(url).responses.create(input="How many ships?", previous_response_id=first.id, **ASK)
            assert turn.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 16 * 16
        stop[0].set()
        for t in threads:
            t.join(timeout=120)
        assert answers and not errors and all(status == 200 for status, _ in answers)
    finally:
        for event in stop:
            event.set()
        serve.delete("auto")
        serve.shutdown()
