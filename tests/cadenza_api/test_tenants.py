"""Tenants never share KV: block hashes are salted with the tenant's key and `cache_salt`, so a
client can neither hit nor count another tenant's cached prompt."""

from __future__ import annotations

from cadenza import LLM, SamplingParams
from cadenza.gateway.state import tenant_salt
from cadenza.messages import EngineRequest

PREFIX = list(range(1, 65))  # four 16-token blocks
GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def _cached_tokens(llm: LLM, rid: str, salt: str | None) -> int:
    llm.engine.add_request(
        EngineRequest(request_id=rid, prompt_token_ids=PREFIX + [70], sampling_params=GREEDY, cache_salt=salt)
    )
    cached = 0
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            cached = out.num_cached_tokens
    return cached


def test_a_prefix_is_found_by_its_own_tenant_only(tiny_model) -> None:
    llm = LLM(str(tiny_model()[0]), num_blocks=64)
    alice, bob = tenant_salt("alice-key", None), tenant_salt("bob-key", None)
    assert _cached_tokens(llm, "a1", alice) == 0
    assert _cached_tokens(llm, "b1", bob) == 0  # the same prompt, another tenant: no hit
    assert _cached_tokens(llm, "a2", alice) == 64  # its own tenant's blocks
    assert _cached_tokens(llm, "n1", None) == 0  # nor does an unsalted request see them


def test_the_salt_is_the_key_and_cache_salt_together() -> None:
    assert tenant_salt(None, None) is None  # one shared cache without either
    assert tenant_salt("k", None) == tenant_salt("k", None) != tenant_salt("k", "s")
    assert tenant_salt("k", "s") != tenant_salt(None, "s") != tenant_salt("other", "s")
    assert "k" not in tenant_salt("k", None)  # a digest, never the key itself


def test_tenants_naming_the_same_session_pin_their_own_prefix(tiny_model) -> None:
    llm = LLM(str(tiny_model()[0]), num_blocks=64, max_pinned_fraction=0.5)
    alice, bob = tenant_salt("alice-key", None), tenant_salt("bob-key", None)
    for rid, salt in (("a1", alice), ("b1", bob)):  # the same prompt_cache_key, "chat"
        llm.engine.add_request(
            EngineRequest(
                request_id=rid, prompt_token_ids=PREFIX + [70], sampling_params=GREEDY, cache_salt=salt,
                session_id="chat",
            )
        )  # fmt: skip
        while llm.engine.has_unfinished():
            llm.engine.step()
    pins = llm.engine.kv.pins
    assert len(pins.pinned("chat", alice)) == 4 and len(pins.pinned("chat", bob)) == 4  # bob's did not replace
    assert set(pins.pinned("chat", alice)).isdisjoint(pins.pinned("chat", bob))  # nor share a block
