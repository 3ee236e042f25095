"""The gateway's process holds no weights, so it never imports torch (~190 MB resident): the
server, the app, the Serve deployment, AsyncLLM and the CLI's parser import with torch made
unimportable. The engine actor imports the model code in its own process."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch imported by the gateway's process")

sys.meta_path.insert(0, NoTorch())
import cadenza.actors.async_llm, cadenza.gateway.app, cadenza.gateway.serve_app, cadenza.gateway.server
from cadenza.cli.main import build_parser

build_parser().parse_args(["serve"])
print("ok")
"""


def test_the_gateway_imports_without_torch() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
