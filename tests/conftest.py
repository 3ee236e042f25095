"""Shared fixtures: tiny random HF checkpoints built here, and the real SmolLM2 (loaded once)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

# Under pytest-xdist (`make test` runs two workers on two cores) each worker, and the Ray
# workers and servers it starts, computes on one thread: two OpenMP teams spinning on two
# cores would stall each other. Set before torch is imported, as OpenMP reads it once.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

if not torch.cuda.is_available():  # Triton kernels run interpreted here; must precede their import
    os.environ.setdefault("TRITON_INTERPRET", "1")
# dtype="auto" is bf16 on CPUs with native bf16 dot products: the suite compares fp32 against
# transformers in fp32 on every machine (its servers and Ray workers inherit this too).
os.environ.setdefault("CADENZA_CPU_AUTO_DTYPE", "float32")
# Likewise int8_activations, which an unset setting turns on on VNNI CPUs: exact by default here.
os.environ.setdefault("CADENZA_CPU_AUTO_INT8_ACTIVATIONS", "0")
# Ray's worker processes and the servers the tests start import test doubles by name
# (cadenza_testkit.faulty_engine): they inherit the folder pytest's `pythonpath` names.
SUPPORT = str(Path(__file__).resolve().parent / "support")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (SUPPORT, os.environ.get("PYTHONPATH")) if p)

from cadenza_testkit.tiny_models import build_tiny_hf  # noqa: E402

from cadenza.models.loader import DEFAULT_MODEL, resolve_model_path  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, torch.nn.Module]]:
    cache: dict[str, tuple[Path, torch.nn.Module]] = {}

    def make(kind: str = "llama_gqa_tied") -> tuple[Path, torch.nn.Module]:
        if kind not in cache:
            directory = tmp_path_factory.mktemp(kind)
            cache[kind] = (directory, build_tiny_hf(kind, directory))
        return cache[kind]

    return make


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    return resolve_model_path(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def smollm(smollm_path: Path):  # noqa: ANN201 - an LLM
    from cadenza import LLM

    return LLM(DEFAULT_MODEL, num_blocks=2048)


@pytest.fixture(scope="session")
def hf_smollm(smollm_path: Path) -> torch.nn.Module:
    """transformers' own GGUF loader on the same file: the oracle for SmolLM2."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        smollm_path.parent, gguf_file=smollm_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def ray_cluster() -> None:
    """One local Ray instance for the whole session (it takes ~15 s to start). Logical CPUs
    exceed the 2 physical ones so TP x PP = 4 workers can be placed. Started as `cadenza serve`
    starts its own: listening on loopback only."""
    import ray

    from cadenza.actors.local_ray import init_local_ray

    # Ray's metrics agents report every 2 s rather than 10 (the Serve test reads its export).
    init_local_ray(8, logging_level="error", _system_config={"metrics_report_interval_ms": 2000})
    yield
    ray.shutdown()


# `make test-quick` (the inner loop) leaves out what needs Ray or the real model: tests that use
# these fixtures, or whose module starts, joins or drives Ray (AsyncLLM is an engine actor).
# Tests slow by what they check (a process of their own, a deadline waited out, thousands of
# engine steps) carry the marker themselves (`pytestmark` or `@pytest.mark.heavy`, with why).
HEAVY_FIXTURES = {"ray_cluster", "server", "smollm", "hf_smollm"}
USES_RAY = re.compile(r"^\s*(import ray|from ray)\b|AsyncLLM\(|launch_server\(|init_local_ray|ensure_ray", re.M)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ray_modules: dict[Path, bool] = {}
    for item in items:
        if item.path not in ray_modules:
            ray_modules[item.path] = bool(USES_RAY.search(item.path.read_text()))
        if ray_modules[item.path] or HEAVY_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.heavy)
