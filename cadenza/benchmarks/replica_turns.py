"""What the replica benchmarks (moved_session, shared_document) time: one turn's first token."""

from __future__ import annotations

import time
from typing import Any

from cadenza.actors.async_llm import AsyncLLM
from cadenza.engine_client import TokensPrompt
from cadenza.gateway.peer_kv import PeerKVEngine
from cadenza.sampling_params import SamplingParams


async def timed_turn(
    engine: AsyncLLM | PeerKVEngine, ids: list[int], params: SamplingParams, salt: str | None = None
) -> tuple[float, int, list[int]]:
    """Seconds to the first token, the prompt's cached tokens, and the tokens."""
    start, first, cached, out = time.perf_counter(), None, 0, []
    async for delta in engine.generate(TokensPrompt(ids), params, cache_salt=salt):
        first = first if first is not None else time.perf_counter() - start
        cached, out = delta.num_cached_tokens, out + delta.outputs[0].token_ids
    assert first is not None
    return first, cached, out


def chat_ids(engine: AsyncLLM | PeerKVEngine, messages: list[dict[str, Any]]) -> list[int]:
    """The chat template's token ids, as the gateway renders them."""
    tok = engine.get_tokenizer()
    return tok.encode_chat(tok.render_chat(messages))
