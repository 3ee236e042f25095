"""Cadenza as a Ray Serve application, deployed from Python (the YAML in deploy/ is the same
app): the OpenAI API on Serve's proxy, queried with the `openai` package, then shut down.

    python examples/ray_serve_app.py      # RAY_ADDRESS joins a running cluster
"""

from __future__ import annotations

import os

import ray
from openai import OpenAI
from ray import serve

from cadenza.gateway.serve_app import build_app

PORT = int(os.environ.get("CADENZA_SERVE_PORT", "8000"))
MODEL = os.environ.get("CADENZA_MODEL", "SmolLM2-135M-Instruct")


def main() -> None:
    ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    app = build_app({"model": MODEL, "engine": {"max_num_seqs": 16}})
    serve.run(app, name="cadenza-example", route_prefix="/")
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused")
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=16
        )
        print(reply.choices[0].message.content)
    finally:
        serve.delete("cadenza-example")


if __name__ == "__main__":
    main()
