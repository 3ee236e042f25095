"""A vLLM user's command line runs unchanged: `cadenza serve MODEL` positional, vLLM's flag
spellings and value forms, its flags that mean nothing here taken with one warning line, the
key from the environment, `cadenza --version`."""

from __future__ import annotations

import subprocess
import sys

import pytest
from cadenza_testkit.servers import VLLM_LINE

from cadenza.cli.main import _resolve_model, build_parser, main
from cadenza.engine_args import engine_kwargs


def _parse(line: str):  # noqa: ANN202 - argparse's Namespace
    args = build_parser().parse_args(line.split())
    _resolve_model(args)
    return args


def test_vllm_spellings_parse_to_our_settings(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse(f"serve /models/m {VLLM_LINE} --dtype half --swap-space 4 -pp 1")
    assert (args.model, args.tensor_parallel_size, args.pipeline_parallel_size, args.seed) == ("/models/m", 1, 1, 0)
    kwargs = engine_kwargs(args)
    assert (kwargs["max_model_len"], kwargs["dtype"], kwargs["enable_prefix_caching"]) == (2000, "float16", True)
    assert _parse("serve m --max-model-len 32K").max_model_len == 32768
    assert not engine_kwargs(_parse("serve m --no-enable-prefix-caching"))["enable_prefix_caching"]
    assert _parse("serve").model == "SmolLM2-135M-Instruct"  # the packaged default


def test_flags_that_mean_nothing_here_warn_once_and_the_model_twice_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "a", "--model", "b", "--enable-chunked-prefill", "--swap-space", "4"]) == 2
    err = capsys.readouterr().err
    assert "ignoring vLLM flags that mean nothing here: --enable-chunked-prefill, --swap-space" in err
    assert "the model is given twice: 'a' and --model 'b'" in err


def test_version_and_the_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    out = subprocess.run([sys.executable, "-m", "cadenza.cli.main", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("cadenza ")
    monkeypatch.setenv("CADENZA_API_KEY", "from-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"
