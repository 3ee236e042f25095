"""A /v1/completions request with several prompts (an array of strings or of token-id arrays,
as the OpenAI API allows and evaluation harnesses send): one CompletionRun per prompt, run
concurrently, answered as one. Prompt i's choices are numbered i * n + j, as OpenAI numbers
them; the whole body's usage is the sum, and so is a stream's final usage chunk."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from cadenza.gateway.completion_run import CompletionRun
from cadenza.gateway.openai_run import sse_event

DONE = "data: [DONE]\n\n"


def _sum_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    total: dict[str, Any] = {}
    for usage in usages:
        for key, value in usage.items():
            if isinstance(value, dict):
                total[key] = _sum_usage([total.get(key, {}), value])
            elif isinstance(value, int):
                total[key] = total.get(key, 0) + value
    return total


class BatchRun:
    def __init__(self, runs: list[CompletionRun], n: int) -> None:
        self.runs, self.n = runs, n

    def release(self) -> None:
        for run in self.runs:
            run.release()

    def close_stream(self) -> None:
        for run in self.runs:
            run.close_stream()

    def renumber(self, prompt: int, choices: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**choice, "index": prompt * self.n + choice["index"]} for choice in choices]

    async def whole(self) -> dict[str, Any]:
        bodies = await asyncio.gather(*(run.whole() for run in self.runs))
        merged = {**bodies[0], "choices": [], "usage": _sum_usage([b["usage"] for b in bodies])}
        for i, body in enumerate(bodies):
            choices = self.renumber(i, body["choices"])
            if "prompt_logprobs" in body:  # per prompt: on its choices, as vLLM gives them
                choices = [{**c, "prompt_logprobs": body["prompt_logprobs"]} for c in choices]
            merged["choices"] += choices
        merged.pop("prompt_logprobs", None)
        return merged

    async def sse(self) -> AsyncIterator[str]:
        """Every prompt's chunks as they come, renumbered under the first prompt's id; each
        stream's usage chunk held back and summed into one at the end, and one [DONE]."""
        queue: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()
        streams = [run.sse() for run in self.runs]

        async def pump(i: int, stream: AsyncIterator[str]) -> None:
            try:
                async for chunk in stream:
                    await queue.put((i, chunk))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        usages: list[dict[str, Any]] = []
        envelope: dict[str, Any] | None = None
        try:
            for _ in range(len(tasks)):
                while (item := await queue.get())[1] is not None:
                    i, chunk = item
                    if chunk == DONE:
                        continue
                    payload = json.loads(chunk.removeprefix("data: "))
                    if "choices" not in payload:  # an error event: as it is
                        yield chunk
                        continue
                    envelope = envelope or {k: v for k, v in payload.items() if k not in ("choices", "usage")}
                    if not payload["choices"] and "usage" in payload:
                        usages.append(payload["usage"])
                        continue
                    yield sse_event({**payload, **envelope, "choices": self.renumber(i, payload["choices"])})
            if usages and envelope is not None:
                yield sse_event({**envelope, "choices": [], "usage": _sum_usage(usages)})
        finally:  # a client gone mid-stream: every prompt's engine request ends now
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
            for stream in streams:
                await stream.aclose()
        yield DONE
