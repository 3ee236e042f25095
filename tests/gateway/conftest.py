"""The shared `cadenza serve` on SmolLM2 for the gateway tests, started once per session."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from cadenza_testkit.servers import API_KEY, MAX_FRAME_BYTES, SPECULATIVE_CONFIG, Server, launch_server


@pytest.fixture(scope="session")
def server(ray_cluster) -> Iterator[Server]:
    """The shared test server: it speculates, with a small frame limit and an API key."""
    args = ["--api-key", API_KEY, "--num-blocks", "2048", "--max-frame-bytes", str(MAX_FRAME_BYTES)]
    args += ["--max-num-batched-tokens", "512", "--speculative-config", json.dumps(SPECULATIVE_CONFIG)]
    with launch_server(args, "serve.log") as srv:
        yield srv
