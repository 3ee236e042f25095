"""What a CUDA graph does, on the CPU: a capture that replays the step over static buffers."""

from __future__ import annotations

from collections.abc import Callable

import torch

from cadenza.actors.cuda_graphs import StepFn


def stand_in_capture(step: StepFn, inputs: dict[str, torch.Tensor]) -> Callable[[], torch.Tensor]:
    """What a graph does, on the CPU: replay the captured step over the same (static) buffers."""
    for buffer in inputs.values():
        buffer.fill_(0)  # a capture reads whatever is there; the replay must not depend on it
    return lambda: step(inputs)
