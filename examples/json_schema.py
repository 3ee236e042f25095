"""Structured output over HTTP: `response_format` with a JSON schema, which the server
enforces token by token, so the reply always parses.

    make serve          # in another terminal
    python examples/json_schema.py
"""

from __future__ import annotations

import json

from _connection import API_KEY, BASE_URL, MODEL
from openai import OpenAI

CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        # An integer with bounds: a free "number" lets a model write digits until max_tokens.
        "population": {"type": "integer", "minimum": 0, "maximum": 100_000_000},
    },
    "required": ["name", "country", "population"],
    "additionalProperties": False,
}


def main() -> None:
    client = OpenAI(base_url=BASE_URL, api_key=API_KEY)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}},
        max_tokens=160,
        temperature=0,
    )
    if reply.choices[0].finish_reason == "length":
        raise SystemExit("the reply hit max_tokens before its JSON closed; raise max_tokens")
    city = json.loads(reply.choices[0].message.content)
    print(json.dumps(city, indent=2))


if __name__ == "__main__":
    main()
