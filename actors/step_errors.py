"""How a step can fail, as the engine actor tells the two apart (here, not in the executor,
so a client that only creates the engine actor loads no model code)."""

from __future__ import annotations


class WorkerFailure(RuntimeError):
    """A worker died, a collective broke or the device failed: the workers' KV is lost, so the
    running requests fail and the workers are rebuilt."""


class StepError(RuntimeError):
    """A step raised inside a live worker (its input broke the forward pass): the step's
    requests fail, the workers and every other request go on."""
