"""`AsyncLLM` from Python: the engine and its workers as Ray actors, tokens streamed as they
are sampled, two requests interleaved (RAY_ADDRESS joins a running cluster; none named starts a
private one on loopback).

    python examples/async_llm_stream.py
"""

from __future__ import annotations

import asyncio
import os

from cadenza import AsyncLLM, SamplingParams


async def ask(llm: AsyncLLM, name: str, prompt: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=24)
    text = ""
    async for delta in llm.generate(prompt, params):
        text += delta.outputs[0].text
    print(f"{name}: {text!r}")


async def main() -> None:
    llm = AsyncLLM(os.environ.get("CADENZA_MODEL", "SmolLM2-135M-Instruct"), ray_address=os.environ.get("RAY_ADDRESS"))
    try:
        await asyncio.gather(ask(llm, "a", "The capital of France is"), ask(llm, "b", "Paged attention is"))
    finally:
        llm.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
