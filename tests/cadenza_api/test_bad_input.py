"""Bad input raises a clear ValueError, never a crash or a hang."""

from __future__ import annotations

from pathlib import Path

import pytest

from cadenza import LLM, SamplingParams
from cadenza.messages import EngineRequest


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    path, _ = tiny_model()
    return LLM(str(path), num_blocks=64, max_model_len=128)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_k=-5), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(n=0), "n must"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_bad_sampling_params(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_empty_prompt(llm: LLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)


def test_prompt_too_long(llm: LLM) -> None:
    with pytest.raises(ValueError, match="max_model_len=128"):
        llm.generate({"prompt_token_ids": [1] * 120}, SamplingParams(max_tokens=16), use_tqdm=False)


def test_token_out_of_vocab(llm: LLM) -> None:
    with pytest.raises(ValueError, match="token ids"):
        llm.generate({"prompt_token_ids": [1, 100000]}, use_tqdm=False)


def test_request_larger_than_pool(tiny_model) -> None:
    path, _ = tiny_model()
    small = LLM(str(path), num_blocks=2, block_size=8)
    with pytest.raises(ValueError, match="KV blocks"):
        small.generate({"prompt_token_ids": [1] * 10}, SamplingParams(max_tokens=20), use_tqdm=False)


def test_text_prompt_without_tokenizer(llm: LLM) -> None:
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello", use_tqdm=False)


def test_duplicate_request_id(llm: LLM) -> None:
    req = EngineRequest(request_id="x", prompt_token_ids=[1, 2], sampling_params=SamplingParams())
    llm.engine.add_request(req)
    with pytest.raises(ValueError, match="already in use"):
        llm.engine.add_request(req)
    llm.engine.abort(["x"])


def test_engine_survives_bad_request(llm: LLM) -> None:
    with pytest.raises(ValueError):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_unknown_model_path() -> None:
    with pytest.raises(ValueError, match="no such file or directory"):
        LLM("/nonexistent/model")


def test_corrupt_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(ValueError, match="broken.gguf"):
        LLM(str(bad))


def test_not_a_model_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLM(str(tmp_path))


def test_bad_engine_args(tiny_model) -> None:
    path, _ = tiny_model()
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(path), block_size=12)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(path), max_model_len=100000)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(top_k=9223372036854775808), "top_k is out of range"),
        (dict(seed=2**64), "seed must be a 64-bit integer"),
        (dict(temperature=float("nan")), "finite"),
        (dict(presence_penalty=float("inf")), "finite"),
        (dict(stop_token_ids=[2**70]), "stop_token_ids"),
    ],
)
def test_numbers_past_64_bits_or_not_finite(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(top_k=161), "vocabulary size 160"),
        (dict(logprobs=21), "max_logprobs"),
        (dict(prompt_logprobs=10**6), "max_logprobs"),
        (dict(stop_token_ids=[160]), r"stop_token_ids must be in \[0, 160\)"),
        (dict(stop=["x"] * 17), "max_stop_strings"),
        (dict(stop=["x" * 257]), "256 characters"),
    ],
)
def test_values_past_the_model_are_refused_before_any_work(llm: LLM, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=4, **kwargs), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_a_temperature_below_1e_5_is_greedy(llm: LLM) -> None:
    prompt = {"prompt_token_ids": [3, 1, 4, 1, 5]}
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    tiny = llm.generate(prompt, SamplingParams(temperature=1e-7, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert tiny[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
