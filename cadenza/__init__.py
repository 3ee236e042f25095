"""Cadenza: actor-based streaming LLM inference.

Exports are lazy so lower layers can import cadenza.config and cadenza.messages without
loading the engine.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutput", "CompletionOutput"]

_EXPORTS = {
    "LLM": "cadenza.llm",
    "AsyncLLM": "cadenza.async_llm",
    "SamplingParams": "cadenza.sampling_params",
    "RequestOutput": "cadenza.outputs",
    "CompletionOutput": "cadenza.outputs",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cadenza' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
