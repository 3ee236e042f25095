"""examples/ray_serve_app.py, run as a user runs it from Python, on the session's Ray with a
tiny model: it deploys, answers through Serve's proxy and deletes its app."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ray_serve_app.py"


@pytest.mark.slow
def test_the_ray_serve_example_deploys_and_answers(
    ray_cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from cadenza_testkit.servers import free_port
    from cadenza_testkit.tiny_models import build_tiny_chat_model
    from ray import serve

    monkeypatch.setenv("CADENZA_MODEL", str(build_tiny_chat_model(tmp_path / "chat")))
    monkeypatch.setenv("CADENZA_SERVE_PORT", str(free_port()))
    spec = importlib.util.spec_from_file_location("ray_serve_app", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        module.main()
        assert capsys.readouterr().out.strip()  # the reply's text
        assert "cadenza-example" not in serve.status().applications  # deleted again
    finally:
        serve.shutdown()
