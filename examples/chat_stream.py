"""Stream a chat completion from `cadenza serve` with the official `openai` package.

make serve          # in another terminal
python examples/chat_stream.py
"""

from __future__ import annotations

from _connection import API_KEY, BASE_URL, MODEL
from openai import OpenAI


def main() -> None:
    client = OpenAI(base_url=BASE_URL, api_key=API_KEY)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Name three uses of a paged KV cache."},
        ],
        max_tokens=64,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            print(f"\n[{chunk.usage.completion_tokens} tokens]")


if __name__ == "__main__":
    main()
