"""The engine's output socket (actors/output_stream.py) without Ray: batches after the
client's ack arrive in order, acknowledged ones are dropped, a client that reconnects with its
last ack loses nothing and sees nothing twice, and a garbage frame ends only that connection."""

from __future__ import annotations

import asyncio
import os
import stat

from cadenza_testkit.waiting import until

from cadenza.actors.output_stream import OutputServer, stream_batches
from cadenza.messages import EngineOutput, OutputBatch


class Published:
    """The engine actor's published batches, as _batches_after / _acknowledge see them."""

    def __init__(self) -> None:
        self.batches: dict[int, list[EngineOutput]] = {}
        self.changed = asyncio.Event()
        self.acked = 0

    def publish(self, n: int) -> None:
        self.batches[n] = [EngineOutput(request_id=f"r{n}", new_token_ids=[n])]
        self.changed.set()

    async def after(self, ack: int) -> OutputBatch:
        while max(self.batches, default=0) <= ack:
            self.changed.clear()
            await self.changed.wait()
        fresh = sorted(k for k in self.batches if k > ack)
        return OutputBatch(last=fresh[-1], outputs=[o for k in fresh for o in self.batches[k]])

    def acknowledge(self, ack: int) -> None:
        self.acked = max(self.acked, ack)
        self.batches = {k: v for k, v in self.batches.items() if k > ack}


async def _read(path: str, ack: int, count: int) -> list[int]:
    seen: list[int] = []
    stream = stream_batches(path, ack)
    async for batch, routed in stream:
        seen += [o.new_token_ids[0] for o in batch.outputs]
        routed()
        if len(seen) >= count:
            break
    await stream.aclose()
    return seen


def test_batches_stream_in_order_and_a_reconnect_resumes_at_the_ack() -> None:
    async def scenario() -> None:
        published = Published()
        server = OutputServer(published.after, published.acknowledge)
        path = await server.start()
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        for n in (1, 2, 3):
            published.publish(n)
        assert await _read(path, 0, 3) == [1, 2, 3]
        await until(lambda: published.acked == 3, "the server saw the client's ack")
        assert published.acked == 3 and not published.batches  # acknowledged, dropped
        for n in (4, 5):
            published.publish(n)
        assert await _read(path, 3, 2) == [4, 5]  # a new connection from the client's ack
        # Garbage ends that connection alone; the server still serves the next one.
        _, writer = await asyncio.open_unix_connection(path)
        writer.write(b"\xff\xff\xff\xff garbage")
        await writer.drain()
        writer.close()
        published.publish(6)
        assert await _read(path, 5, 1) == [6]
        server.close()
        assert not os.path.exists(path)

    asyncio.run(scenario())
