"""Every example in examples/ runs, as a user runs it, against the shared test server (the
HTTP ones, curl and LangChain's ChatOpenAI unchanged) or on its own (the offline LLM, AsyncLLM
on the session's Ray)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cadenza_testkit.servers import API_KEY, Server

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(command: list[str], env: dict[str, str]) -> str:
    out = subprocess.run(command, cwd=EXAMPLES, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _against(server: Server) -> dict[str, str]:
    return {"CADENZA_BASE_URL": server.http + "/v1", "CADENZA_API_KEY": API_KEY}


def test_chat_stream(server: Server) -> None:
    assert "tokens]" in _run([sys.executable, "chat_stream.py"], _against(server))


def test_tool_call(server: Server) -> None:
    out = _run([sys.executable, "tool_call.py"], _against(server))
    assert out.startswith("call: get_weather({'city': ") and "answer: " in out


def test_json_schema(server: Server) -> None:
    city = json.loads(_run([sys.executable, "json_schema.py"], _against(server)))
    assert set(city) == {"name", "country", "population"}


def test_curl(server: Server) -> None:
    reply = json.loads(_run(["sh", "curl.sh"], _against(server)))
    assert reply["choices"][0]["message"]["content"]


def test_langchain_chat_openai(server: Server) -> None:
    out = _run([sys.executable, "langchain_chat.py"], _against(server))
    assert len(out.strip().splitlines()) >= 2  # the invoke's answer, then the streamed one


def test_offline_llm_with_structured_output() -> None:
    out = _run([sys.executable, "offline_structured.py"], {})
    answer = json.loads(out.split("json: ", 1)[1])
    assert set(answer) == {"answer", "confident"}


@pytest.mark.slow
def test_async_llm_stream(ray_cluster) -> None:
    import ray

    out = _run([sys.executable, "async_llm_stream.py"], {"RAY_ADDRESS": ray.get_runtime_context().gcs_address})
    assert out.count(": '") == 2  # both requests answered
