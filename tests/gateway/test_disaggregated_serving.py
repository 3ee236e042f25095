"""`cadenza serve --disaggregation 1P1D`: the official SDK's streaming chat and the websocket
Responses API over a prefill engine and a decode engine give the one-engine greedy text, and
/stats shows both engines and the KV hand-overs."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator

import openai
import pytest
import websockets
from cadenza_testkit.servers import API_KEY, Server, launch_server

from cadenza import SamplingParams

MODEL = "SmolLM2-135M-Instruct"
# Long enough for full KV blocks to move (the chat template adds a system turn).
QUESTION = [{"role": "user", "content": "In two sentences, what is a paged KV cache and why does it help serving?"}]


@pytest.fixture(scope="module")
def split(ray_cluster) -> Iterator[Server]:  # noqa: ANN001
    # Every prompt through the prefill engine, so the hand-over runs (a chat turn this short
    # would otherwise be prefilled on the decode engine: max_local_prefill_tokens).
    args = ["--disaggregation", "1P1D", "--api-key", API_KEY, "--num-blocks", "256", "--max-local-prefill-tokens", "0"]
    with launch_server(args, "serve_disaggregated.log") as srv:
        yield srv


@pytest.mark.slow
def test_sdk_stream_and_websocket_equal_one_engine(split: Server, smollm) -> None:  # noqa: ANN001
    expected = smollm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    client = openai.OpenAI(base_url=split.http + "/v1", api_key=API_KEY)
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=16, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
    create = {"type": "response.create", "model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 16}

    async def over_websocket() -> str:
        async with websockets.connect(split.ws, additional_headers={"Authorization": f"Bearer {API_KEY}"}) as ws:
            await ws.send(json.dumps(create))
            text = ""
            last = ("response.completed", "response.incomplete", "response.failed")
            while (event := json.loads(await ws.recv()))["type"] not in last:
                text += event.get("delta", "") if event["type"] == "response.output_text.delta" else ""
            return text

    assert asyncio.run(over_websocket()) == expected
    stats = split.get("/stats")["engine"]
    assert [role for role, _ in stats["roles"]] == ["prefill", "decode"]
    moved = stats["kv_transfer"]
    assert moved["num_handoffs"] == 2 and moved["num_fallbacks"] == 0
    assert moved["num_blocks_imported"] > 0 and moved["num_blocks_skipped"] > 0  # the second ask found them
    request = urllib.request.Request(split.http + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=30) as r:
        metrics = r.read().decode()
    assert "cadenza:kv_transfer_handoffs_total" in metrics and "cadenza:kv_transfer_blocks_imported_total" in metrics
