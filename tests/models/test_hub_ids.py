"""A model named by Hugging Face Hub id (`cadenza serve Qwen/Qwen3-0.6B`, as vLLM takes it)
resolves to its snapshot in the Hub cache. No network here: the cache is built in the test
in the Hub's own layout and HF_HUB_OFFLINE is set, which is also how an air-gapped host runs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cadenza import LLM, SamplingParams
from cadenza.models.hub import looks_like_hub_id
from cadenza.models.model_files import resolve_model_path

GREEDY = SamplingParams(temperature=0, max_tokens=6)


def _cache_with(tmp_path: Path, repo_id: str, model_dir: Path) -> Path:
    """models--org--name/refs/main -> snapshots/<commit>/ holding the model's files."""
    cache, commit = tmp_path / "hub", "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    return cache


def test_a_hub_id_loads_the_cached_snapshot(tiny_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = tiny_model("qwen3_qk_norm")
    monkeypatch.setenv("HF_HUB_CACHE", str(_cache_with(tmp_path, "cadenza-tests/tiny-qwen3", path)))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_path("cadenza-tests/tiny-qwen3").name == "0123456789abcdef0123456789abcdef01234567"
    prompt = {"prompt_token_ids": [5, 6, 7]}
    by_id = LLM("cadenza-tests/tiny-qwen3", num_blocks=32).generate(prompt, GREEDY)
    by_path = LLM(str(path), num_blocks=32).generate(prompt, GREEDY)
    assert by_id[0].outputs[0].token_ids == by_path[0].outputs[0].token_ids


def test_a_hub_id_not_in_the_cache_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"'nobody/nothing': not a local path, and not found in the local Hub cache"):
        resolve_model_path("nobody/nothing")


def test_what_counts_as_a_hub_id() -> None:
    assert looks_like_hub_id("Qwen/Qwen3-0.6B") and looks_like_hub_id("meta-llama/Llama-3.2-1B-Instruct")
    assert not looks_like_hub_id("/abs/model") and not looks_like_hub_id("a/b/c") and not looks_like_hub_id("x.gguf")


def test_revision_and_download_dir_flags_pick_the_cache_and_the_ref(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """`cadenza generate --model org/name --download-dir D --revision v1` as vLLM spells it:
    the cache D, the snapshot tag v1 points at; an unknown ref is one clear error."""
    from cadenza_testkit.tiny_models import build_tiny_chat_model

    from cadenza.cli.main import main

    model = build_tiny_chat_model(tmp_path / "chat")
    cache = _cache_with(tmp_path, "cadenza-tests/tiny-chat", model)
    repo = cache / "models--cadenza-tests--tiny-chat"
    (repo / "refs" / "main").write_text("f" * 40)  # main points nowhere: only v1 resolves
    (repo / "refs" / "v1").write_text("0123456789abcdef0123456789abcdef01234567")
    for name in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "CADENZA_HUB_REVISION"):
        monkeypatch.setenv(name, "1" if name == "HF_HUB_OFFLINE" else "")
    args = ["generate", "--model", "cadenza-tests/tiny-chat", "--download-dir", str(cache), "--max-tokens", "3"]
    assert main([*args, "--revision", "v1", "hello"]) == 0
    assert main([*args, "--revision", "v2", "hello"]) == 2
    assert "not found in the local Hub cache" in capsys.readouterr().err
