"""Errors an engine client raises, shared by every layer above the engine (the gateway maps
them to HTTP statuses and `error` events without importing the engine)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine is gone (its actor died or it was shut down); create a new client."""


class RequestFailedError(RuntimeError):
    """The engine ended this request with an error (e.g. a worker died mid-step)."""
