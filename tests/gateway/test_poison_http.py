"""The issue's poison requests over HTTP, against the shared server: each is a 400 naming the
problem, a stream running beside them completes with the engine's greedy text, and no worker
is rebuilt (before, a top_k past int64 raised inside a worker's step and failed everyone)."""

from __future__ import annotations

import json
import threading

import pytest

from cadenza import SamplingParams

MODEL = "SmolLM2-135M-Instruct"
POISON = [
    ({"prompt": "hi", "top_k": 9223372036854775808}, "top_k"),
    ({"prompt": "hi", "top_k": 10**6}, "top_k"),
    ({"prompt": [1, 2, 10**6]}, "prompt token ids"),
    ({"prompt": [1, 2**64]}, "64"),
    ({"prompt": "hi", "seed": 2**64}, "64"),
    ({"prompt": "hi", "stop": ["x"] * 5000}, "stop strings"),
    ({"prompt": "hi", "max_tokens": 10**9}, "context"),
]


def _post(server, path: str, body: dict) -> tuple[int, dict]:  # noqa: ANN001
    return server.post(path, json.dumps(body).encode())


@pytest.mark.slow
def test_poison_requests_are_400s_beside_a_live_stream_with_no_rebuild(server, smollm) -> None:
    question = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    expected = smollm.chat(question, SamplingParams(temperature=0, max_tokens=32))[0].outputs[0].text
    restarts = server.get("/stats")["engine"]["num_worker_restarts"]
    live: dict = {}
    body = {"model": MODEL, "messages": question, "temperature": 0, "max_tokens": 32}
    thread = threading.Thread(
        target=lambda: live.update(zip(("status", "body"), _post(server, "/v1/chat/completions", body)))
    )
    thread.start()
    for poison, message in POISON:
        status, answer = _post(server, "/v1/completions", {"model": MODEL, **poison})
        assert status == 400, (poison, answer)
        assert message in answer["error"]["message"], (poison, answer)
    thread.join(timeout=120)
    assert live["status"] == 200 and live["body"]["choices"][0]["message"]["content"] == expected
    assert server.get("/stats")["engine"]["num_worker_restarts"] == restarts
