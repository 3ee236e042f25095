"""The model's generation_config.json sampling defaults apply where a request leaves a field
unset (vLLM's --generation-config auto); `vllm` turns them off; a request's own value wins."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from cadenza_testkit.servers import PacedEngine, free_port, serve_in_thread

from cadenza.gateway.app import build_app
from cadenza.gateway.settings import GatewaySettings
from cadenza.models.generation_config import sampling_defaults
from cadenza.models.loader import DEFAULT_MODEL

QWEN3_LIKE = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "eos_token_id": 2}


class RecordingEngine(PacedEngine):
    """Answers one token and keeps the SamplingParams each request arrived with."""

    sampling_defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}

    def __init__(self) -> None:
        super().__init__(0.0)
        self.seen: list[Any] = []

    async def generate(self, prompt: dict, params: Any, request_id: str, **kw: Any):  # noqa: ANN201
        self.seen.append(params)
        async for out in super().generate(prompt, params, request_id, **kw):
            yield out


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[openai.OpenAI, RecordingEngine]]:
    engine = RecordingEngine()
    settings = GatewaySettings(port=free_port())
    with serve_in_thread(build_app(engine, DEFAULT_MODEL, settings), settings.port):
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{settings.port}/v1", api_key="none"), engine


def test_unset_fields_take_the_models_defaults_and_set_ones_win(served) -> None:  # noqa: ANN001
    client, engine = served
    messages = [{"role": "user", "content": "hi"}]
    client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=1)
    client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=1, temperature=0.2, top_p=0.5)
    client.completions.create(model=DEFAULT_MODEL, prompt="hi", max_tokens=1, extra_body={"top_k": 5})
    client.responses.create(model=DEFAULT_MODEL, input="hi", max_output_tokens=16)
    first, second, third, fourth = engine.seen[-4:]
    assert (first.temperature, first.top_p, first.top_k, first.min_p) == (0.6, 0.95, 20, 0.0)
    assert (second.temperature, second.top_p, second.top_k) == (0.2, 0.5, 20)
    assert (third.temperature, third.top_k) == (0.6, 5)
    assert (fourth.temperature, fourth.top_p, fourth.top_k) == (0.6, 0.95, 20)  # the Responses API too


def test_the_defaults_are_read_from_the_model_a_folder_or_nowhere(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "generation_config.json").write_text(json.dumps(QWEN3_LIKE))
    assert sampling_defaults(str(model)) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert sampling_defaults(str(model), "vllm") == {}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.1}))
    assert sampling_defaults(str(model), str(other)) == {"repetition_penalty": 1.1}
    with pytest.raises(ValueError, match="no generation_config.json in that folder"):
        sampling_defaults(str(model), str(tmp_path))
    assert sampling_defaults(DEFAULT_MODEL) == {}  # a GGUF carries none
