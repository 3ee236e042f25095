"""Stream a two-turn conversation from `cadenza serve` with the official `openai` package,
over the Responses WebSocket (`client.responses.connect()`).

    make serve          # in another terminal
    python examples/openai_responses_ws.py
"""

from __future__ import annotations

import asyncio

from openai import AsyncOpenAI


async def main() -> None:
    client = AsyncOpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused-unless---api-key")
    previous = None
    async with client.responses.connect() as conn:
        for question in ["Give me a name for a friendly robot.", "Why that name?"]:
            print(f"> {question}")
            await conn.response.create(
                model="SmolLM2-135M-Instruct", input=question, max_output_tokens=96, previous_response_id=previous
            )
            async for event in conn:
                if event.type == "response.output_text.delta":
                    print(event.delta, end="", flush=True)
                elif event.type in ("response.completed", "response.incomplete", "response.failed"):
                    previous = event.response.id
                    print(f"\n[{event.response.status}, {event.response.usage.output_tokens} tokens]")
                    break
                elif event.type == "error":
                    raise SystemExit(event.error.message)


if __name__ == "__main__":
    asyncio.run(main())
