"""A step's samples while they are still where the logits were.

Scheduling ahead on a GPU, the runner launches step N + 1 before step N's tokens reach the
host: N + 1's input ids are gathered from N's sampled ids on the device (fed_ids), and the
copy to the host runs behind the GPU's queue into pinned memory, finished by an event the
host waits on only once step N + 1 is launched. Reading a CUDA tensor's value (.tolist()) at
step N would instead stall the host until the GPU drains, leaving it idle while the host
prepares N + 1. On the CPU the values are ready when computed and there is nothing to wait for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from cadenza.actors.device_copy import take_rows, to_device
from cadenza.messages import ModelRunnerOutput, TokenLogprobs


@dataclass(slots=True)
class LogprobTensors:
    """The sampled tokens' logprobs, computed on the device for every row (read where asked)."""

    asked: list[int | None]  # per row: how many alternatives, or None for no logprobs
    chosen: torch.Tensor  # [N] the sampled token's logprob
    rank: torch.Tensor  # [N] its 1-based rank
    top_values: torch.Tensor  # [N, k_max] the k_max most likely tokens' logprobs, descending
    top_ids: torch.Tensor  # [N, k_max]

    @classmethod
    def of(cls, raw: torch.Tensor, tokens: torch.Tensor, asked: list[int | None]) -> LogprobTensors:
        """raw: log-softmax [N, V]; tokens [N]. One top-k at the largest k asked: its first k
        are the top k."""
        chosen = raw.gather(1, tokens[:, None]).squeeze(1)
        rank = (raw > chosen[:, None]).sum(dim=1) + 1
        top = torch.topk(raw, max(k or 0 for k in asked), dim=-1)
        return cls(asked, chosen, rank, top.values, top.indices)

    def tensors(self) -> list[torch.Tensor]:
        return [self.chosen, self.rank, self.top_values, self.top_ids]

    def entries(self, tokens: list[int], host: list[torch.Tensor] | None = None) -> list[TokenLogprobs | None]:
        """The host's entries, from host copies of tensors() in that order (default: these)."""
        chosen, rank, values, ids = (t.tolist() for t in (self.tensors() if host is None else host))
        return [
            None if k is None else TokenLogprobs([t, *ids[i][:k]], [chosen[i], *values[i][:k]], rank[i])
            for i, (t, k) in enumerate(zip(tokens, self.asked, strict=True))
        ]


@dataclass(slots=True)
class DeviceSamples:
    """One step's sampled ids (one per request: no drafts when scheduling ahead) and logprobs."""

    req_ids: list[str]
    tokens: torch.Tensor  # [N] int64 on the logits' device
    logprobs: LogprobTensors | None
    _host: list[torch.Tensor] = field(default_factory=list)
    _ready: torch.cuda.Event | None = None
    _values: tuple[list[int], list[TokenLogprobs | None]] | None = None

    def __post_init__(self) -> None:
        device = [self.tokens, *(self.logprobs.tensors() if self.logprobs is not None else [])]
        if not self.tokens.is_cuda:
            self._host = device
            return
        # Pinned, so the copy is asynchronous; torch's host allocator recycles the buffers.
        self._host = [torch.empty_like(t, device="cpu", pin_memory=True) for t in device]
        for host, dev in zip(self._host, device, strict=True):
            host.copy_(dev, non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def copied(self) -> bool:
        return self._ready is None or self._ready.query()

    def row_of(self) -> dict[str, int]:
        return {rid: i for i, rid in enumerate(self.req_ids)}

    def values(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The tokens and logprobs on the host, waiting for the copy the first time. Two
        threads may both ask (the runner for its bookkeeping, the engine for the output):
        both compute the same lists from the same finished copy."""
        if self._values is None:
            if self._ready is not None:
                self._ready.synchronize()
            tokens = self._host[0].tolist()
            logprobs = self.logprobs.entries(tokens, self._host[1:]) if self.logprobs is not None else None
            self._values = tokens, logprobs or [None] * len(tokens)
        return self._values


def fed_ids(input_ids: torch.Tensor, rows: list[int], previous: DeviceSamples, req_ids: list[str]) -> None:
    """Write the previous step's sampled ids into input_ids at the flat rows that wait for
    them (placeholders so far), on the device: req_ids[i]'s token goes to rows[i]."""
    if not rows:
        return
    at = previous.row_of()
    tokens = take_rows(previous.tokens, [at[rid] for rid in req_ids])
    input_ids.index_copy_(0, to_device(rows, torch.long, input_ids.device), tokens.to(input_ids.dtype))


@dataclass(slots=True)
class PendingOutput:
    """A step's output whose samples may still be on the device; result() fills them in.
    The runner returns it when scheduling ahead, so the step thread can launch the next step
    while whoever reads the output waits for the copy."""

    output: ModelRunnerOutput
    samples: DeviceSamples | None

    def ready(self) -> bool:
        """Whether result() would return without waiting for the device."""
        return self.samples is None or self.samples.copied()

    def result(self) -> ModelRunnerOutput:
        if self.samples is not None:
            tokens, logprobs = self.samples.values()
            for rid, token, lp in zip(self.samples.req_ids, tokens, logprobs, strict=True):
                self.output.sampled[rid] = [token]
                if lp is not None:
                    self.output.logprobs[rid] = [lp]
            self.samples = None
            if self.output.timing:  # the output is had when it reaches the host
                self.output.timing[-1] = time.monotonic()
        return self.output


def landed(result: ModelRunnerOutput | PendingOutput) -> ModelRunnerOutput:
    """The step's output on the host, waiting for it if it is pending."""
    return result.result() if isinstance(result, PendingOutput) else result
