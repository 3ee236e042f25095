"""Loading a model on the CPU imports neither torch._dynamo nor Triton: the model is built on
the meta device, where torch.arange goes through torch's decompositions, which import both
(about a second of every engine's start and ~100 MB of its resident memory, measured)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

LOAD = """
import json, sys
from cadenza.config import EngineConfig
from cadenza.models.loader import load_model
load_model(sys.argv[1], EngineConfig(model=sys.argv[1]).weight_format, "cpu")
print(json.dumps([m for m in ("torch._dynamo", "triton") if m in sys.modules]))
"""


def test_a_cpu_load_leaves_dynamo_and_triton_unimported(
    tiny_model: Callable[[str], tuple[Path, torch.nn.Module]],
) -> None:
    path, _ = tiny_model("llama_gqa_tied")
    out = subprocess.run([sys.executable, "-c", LOAD, str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == []
