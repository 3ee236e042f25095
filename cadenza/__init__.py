"""Cadenza: actor-based streaming LLM inference.

Exports are lazy so lower layers can import cadenza.config and cadenza.messages without
loading the engine.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "LLM",
    "AsyncLLM",
    "DisaggregatedLLM",
    "InProcessClient",
    "EngineClient",
    "TokensPrompt",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
]

# The package root is the public facade, so it is the one module of the base layer that names
# upper layers; the imports run on first attribute access only (tests/test_layers.py).
_EXPORTS = {
    "LLM": "cadenza.actors.llm",
    "AsyncLLM": "cadenza.actors.async_llm",
    "DisaggregatedLLM": "cadenza.actors.disaggregated",
    "InProcessClient": "cadenza.actors.inprocess_client",
    "EngineClient": "cadenza.engine_client",
    "TokensPrompt": "cadenza.engine_client",
    "SamplingParams": "cadenza.sampling_params",
    "RequestOutput": "cadenza.outputs",
    "CompletionOutput": "cadenza.outputs",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cadenza' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
