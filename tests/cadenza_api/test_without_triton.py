"""Installs where llama.cpp users are: the CPU path imports no Triton, so a host without a
Triton wheel installs Cadenza and serves. One test runs the in-process engine with Triton and
Ray unimportable (it needs neither: a GPU host without Ray runs the GPU check through it);
the other builds the wheel, installs it into a venv that lacks Triton and serves a request."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest
from cadenza_testkit.servers import free_port
from cadenza_testkit.tiny_models import build_tiny_chat_model

ROOT = Path(__file__).resolve().parents[2]
# Put first on sys.meta_path, this makes `import triton` (and `import ray`) fail as on a host
# without the wheel.
NO_TRITON = """
import sys
class NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("triton", "ray"):
            raise ImportError("no module named " + repr(name) + " (hidden by the test)")
sys.meta_path.insert(0, NoTriton())
"""


def _python(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", NO_TRITON + code], capture_output=True, text=True, timeout=300, cwd=cwd,
        env={**os.environ, **env},
    )  # fmt: skip


@pytest.mark.heavy  # not in make test-quick: two Python processes of their own
def test_the_cpu_engine_runs_without_triton_or_ray(tmp_path: Path) -> None:
    model = build_tiny_chat_model(tmp_path / "tiny")
    code = f"""
from cadenza import LLM, SamplingParams
out = LLM({str(model)!r}, num_blocks=64).generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 4
assert "triton" not in sys.modules, "the CPU path imported Triton"
assert "ray" not in sys.modules, "the in-process engine imported Ray"
print("served without triton")
"""
    done = _python(code, tmp_path)
    assert done.returncode == 0 and "served without triton" in done.stdout, done.stderr[-3000:]
    asked = _python("from cadenza.kernels.ops import BUNDLES\nBUNDLES['triton']", tmp_path)
    assert "CADENZA_KERNELS=triton needs Triton, which does not import here" in asked.stderr


def _venv_without_triton(tmp: Path) -> Path:
    """A venv holding this environment's packages (linked, not copied) but Triton and Cadenza."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp / "venv")], check=True, timeout=120)
    site = next((tmp / "venv" / "lib").glob("python3*/site-packages"))
    ours = Path(next(p for p in sys.path if p.endswith("site-packages") and Path(p, "torch").exists()))
    for entry in ours.iterdir():
        name = entry.name.lower()
        if not (name.startswith(("triton", "cadenza", "__editable__")) or "cadenza" in name):
            (site / entry.name).symlink_to(entry)
    return tmp / "venv" / "bin" / "python"


@pytest.mark.slow
def test_the_wheel_installs_and_serves_without_triton(tmp_path: Path) -> None:
    # Built from a copy: setuptools writes build/ and *.egg-info beside the sources.
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "build", "tests", "docs", "*.egg-info"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp_path, source],
        check=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    wheel = next(tmp_path.glob("cadenza-*.whl"))
    metadata = zipfile.ZipFile(wheel).read(next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith("METADATA")))
    triton_req = [line for line in metadata.decode().splitlines() if line.startswith("Requires-Dist: triton")]
    assert triton_req and "sys_platform" in triton_req[0]  # only where Triton publishes wheels
    python = _venv_without_triton(tmp_path)
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True, timeout=300
    )
    probe = subprocess.run([python, "-c", "import triton"], capture_output=True, text=True, cwd=tmp_path)
    assert probe.returncode != 0  # the venv really lacks it
    model, port = build_tiny_chat_model(tmp_path / "tiny"), free_port()
    args = [python, "-m", "cadenza.cli.main", "serve", str(model), "--served-model-name", "tiny"]
    args += ["--in-process", "--port", str(port)]
    server = subprocess.Popen(
        [*args, "--num-blocks", "64"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        body = _first_answer(port, server)
        assert body["usage"]["completion_tokens"] == 3 and body["choices"][0]["text"]
    finally:
        server.terminate()
        server.wait(timeout=60)


def _first_answer(port: int, server: subprocess.Popen) -> dict:
    request = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
    deadline = time.monotonic() + 300  # a hang guard only
    while time.monotonic() < deadline:
        assert server.poll() is None, server.stdout.read().decode()[-3000:]
        try:
            data = json.dumps(request).encode()
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions", data, {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{e.code}: {e.read().decode()}") from None
        except OSError:  # not listening yet
            time.sleep(0.5)
    raise AssertionError("the server never answered")
