"""`cadenza serve --in-process`: the gateway over the InProcessClient (no Ray, no actors)
answers the HTTP API and the websocket with the offline engine's greedy text."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import openai
import pytest
import websockets
from cadenza_testkit.servers import API_KEY, Server, launch_server

from cadenza import SamplingParams

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def in_process() -> Iterator[Server]:
    with launch_server(["--in-process", "--api-key", API_KEY, "--num-blocks", "256"], "serve_in_process.log") as srv:
        yield srv


@pytest.mark.slow
def test_http_chat_equals_the_engine_and_no_worker_runs(in_process: Server, smollm) -> None:
    expected = smollm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    client = openai.OpenAI(base_url=in_process.http + "/v1", api_key=API_KEY)
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=16)
    assert whole.choices[0].message.content == expected
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=16, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
    stats = in_process.get("/stats")["engine"]
    assert stats["num_workers"] == 0 and stats["worker_pids"] == []
    assert stats["engine"]["kv_cache"]["num_free_blocks"] == 256


@pytest.mark.slow
def test_websocket_response_equals_the_engine(in_process: Server, smollm) -> None:
    expected = smollm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    create = {"type": "response.create", "model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 12}

    async def run() -> tuple[str, str]:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with websockets.connect(in_process.ws, additional_headers=headers) as ws:
            await ws.send(json.dumps(create))
            text = ""
            while True:
                event = json.loads(await ws.recv())
                if event["type"] == "response.output_text.delta":
                    text += event["delta"]
                if event["type"] in ("response.completed", "response.failed", "error"):
                    return text, event["type"]

    text, last = asyncio.run(run())
    assert last == "response.completed"
    assert text == expected
