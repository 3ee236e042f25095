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
        "population_millions": {"type": "number"},
    },
    "required": ["name", "country", "population_millions"],
    "additionalProperties": False,
}


def main() -> None:
    client = OpenAI(base_url=BASE_URL, api_key=API_KEY)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}},
        max_tokens=96,
    )
    city = json.loads(reply.choices[0].message.content)
    print(json.dumps(city, indent=2))


if __name__ == "__main__":
    main()
