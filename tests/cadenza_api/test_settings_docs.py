"""Settings as one source of truth: every engine and gateway setting is a field with its group
and doc, every one (the model aside) is a flag of the same name, a flag sets the same value the
keyword does, and docs/settings.md's tables are exactly what the fields make."""

from __future__ import annotations

import dataclasses

import pytest

from cadenza.cli.main import _resolve_model, build_parser
from cadenza.cli.settings_docs import main as settings_docs
from cadenza.cli.settings_docs import render
from cadenza.config import EngineConfig
from cadenza.engine_args import engine_kwargs
from cadenza.gateway.server import settings_from_args
from cadenza.gateway.settings import GatewaySettings
from cadenza.setting import info_of

VLLM_GROUPS = {"model", "cache", "scheduler", "parallel", "speculative", "device"}


def _serve(*flags: str):  # noqa: ANN202 - argparse's Namespace
    args = build_parser().parse_args(["serve", *flags])
    _resolve_model(args)
    return args


def test_the_settings_page_is_made_from_the_fields(capsys: pytest.CaptureFixture[str]) -> None:
    assert settings_docs(["--check"]) == 0, capsys.readouterr().err
    for cls in (EngineConfig, GatewaySettings):
        for field in dataclasses.fields(cls):
            meta = info_of(field)  # raises for a field without setting(...)
            assert meta.doc and "\n" not in meta.doc and meta.group, field.name
            assert f"| `{field.name}` |" in render(cls)
    assert VLLM_GROUPS <= {info_of(f).group for f in dataclasses.fields(EngineConfig)}


def test_every_engine_setting_is_a_flag_with_the_keywords_default() -> None:
    defaults, kwargs = EngineConfig(), engine_kwargs(_serve())
    flagged = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    assert set(kwargs) == flagged
    assert all(kwargs[name] == getattr(defaults, name) for name in flagged)
    assert settings_from_args(_serve()) == GatewaySettings()


def test_flags_set_what_the_keywords_set() -> None:
    line = (
        "--seed 7 --num-blocks 64 --kv-cache-memory 1048576 --executor ray --distributed-timeout-s 5 "
        "--max-engine-restarts 0 --no-use-compiled-graph --enable-expert-parallel -tp 2 --device cuda:1 "
        '--speculative-config {"method":"ngram","num_speculative_tokens":3} --no-prefix-caching --max-model-len 4k'
    )
    kwargs = engine_kwargs(_serve(*line.split()))
    config = EngineConfig(**kwargs)
    assert (config.seed, config.num_blocks, config.kv_cache_memory, config.executor) == (7, 64, 1 << 20, "ray")
    assert (config.distributed_timeout_s, config.max_engine_restarts, config.use_compiled_graph) == (5.0, 0, False)
    assert (config.enable_expert_parallel, config.tensor_parallel_size, config.device) == (True, 2, "cuda:1")
    assert config.speculative_config.num_speculative_tokens == 3 and not config.enable_prefix_caching
    assert config.max_model_len == 4000
    gateway = settings_from_args(_serve("--allowed-origins", "http://a", "http://b", "--no-stream-pacing"))
    assert gateway.allowed_origins == ("http://a", "http://b") and not gateway.stream_pacing


def test_a_bad_value_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _serve("--speculative-config", "{not json")
    assert "not JSON" in capsys.readouterr().err
    with pytest.raises(ValueError, match="device must be one of"):
        EngineConfig(**engine_kwargs(_serve("--device", "tpu")))
