"""A bare `websockets` client: two lanes streaming at once on one socket, a third response
cancelled mid-stream with Cadenza's `response.cancel`.

    make serve          # in another terminal
    python examples/ws_two_lanes.py
"""

from __future__ import annotations

import asyncio
import json

import websockets

URL = "ws://127.0.0.1:8000/v1/responses"


async def main() -> None:
    async with websockets.connect(URL) as ws:  # add additional_headers={"Authorization": "Bearer KEY"}
        for lane, text in [("poem", "Write a short poem about rain."), ("facts", "Three facts about owls.")]:
            await ws.send(json.dumps({"type": "response.create", "input": text, "stream_id": lane}))
        await ws.send(json.dumps({"type": "response.create", "input": "Tell me a long story.", "stream_id": "story"}))
        texts: dict[str, str] = {}
        ids: dict[str, str] = {}
        finished, cancelled = 0, False
        while finished < 3:
            event = json.loads(await ws.recv())
            lane = event.get("stream_id")
            if event["type"] == "response.created":
                ids[lane] = event["response"]["id"]
            elif event["type"] == "response.output_text.delta":
                texts[lane] = texts.get(lane, "") + event["delta"]
                if lane == "story" and len(texts[lane]) > 80 and not cancelled:  # enough of that one
                    await ws.send(json.dumps({"type": "response.cancel", "response_id": ids["story"]}))
                    cancelled = True
            elif event["type"] in ("response.completed", "response.incomplete", "response.failed"):
                finished += 1
                print(f"--- {lane}: {event['response']['status']}\n{texts.get(lane, '')}\n")
            elif event["type"] == "error":
                print("error:", event["error"]["message"])
                finished += 1


if __name__ == "__main__":
    asyncio.run(main())
