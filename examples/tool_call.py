"""Ask for a tool call with the `openai` package: the server constrains the reply to the
named function's JSON arguments (tool_choice naming a function), then the result goes back
as a `tool` message for the final answer.

    make serve          # in another terminal
    python examples/tool_call.py
"""

from __future__ import annotations

import json

from _connection import API_KEY, BASE_URL, MODEL
from openai import OpenAI

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 32}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def main() -> None:
    client = OpenAI(base_url=BASE_URL, api_key=API_KEY)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64,
    )
    call = first.choices[0].message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    print(f"call: {call.function.name}({arguments})")
    messages += [first.choices[0].message.model_dump(exclude_none=True)]
    messages += [{"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 18, "sky": "clear"})}]
    final = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48)
    print(f"answer: {final.choices[0].message.content}")


if __name__ == "__main__":
    main()
