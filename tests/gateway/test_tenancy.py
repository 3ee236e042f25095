"""Issue #38, tenancy: a response, its events, its stored conversation and its session belong to
the tenant that made it (the API key, with the request's cache_salt). To any other tenant each
is not found, with the message an unknown id gets. And what the gateway keeps of a response
is what it validated: the store is sent one turn per write, the response object echoes the
request's validated fields only. Over a real uvicorn socket with an engine double (no model,
no Ray); no test asserts a duration."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import msgspec
import openai
import pytest
from cadenza_testkit.servers import PacedEngine, free_port, serve_in_thread

from cadenza.gateway.app import build_app
from cadenza.gateway.response_store import LocalStore, StoredResponse
from cadenza.gateway.settings import GatewaySettings
from cadenza.models.loader import DEFAULT_MODEL


class RecordingStore(LocalStore):
    """The in-process store, recording every write (what the shared store's actor is sent)."""

    def __init__(self) -> None:
        super().__init__(64, 3600.0)
        self.writes: list[StoredResponse] = []

    async def put(self, item: StoredResponse) -> None:
        self.writes.append(item)
        await super().put(item)


@contextlib.contextmanager
def gateway(store: RecordingStore | None = None, **overrides: object) -> Iterator[str]:
    """No api_key on the server: every key a client presents is accepted, and is its tenant."""
    settings = GatewaySettings(port=free_port(), **overrides)
    app = build_app(PacedEngine(pace=0.005), DEFAULT_MODEL, settings, store=store)
    with serve_in_thread(app, settings.port):
        yield f"http://127.0.0.1:{settings.port}/v1"


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with gateway() as url:
        yield url


def _client(base_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)


def _not_found(call, response_id: str) -> str:  # noqa: ANN001
    """The 404's message with the id taken out (it names the id asked for)."""
    with pytest.raises(openai.NotFoundError) as e:
        result = call()
        if isinstance(result, openai.Stream):
            list(result)
    return e.value.body["message"].replace(response_id, "ID")


def test_another_tenants_running_response_is_not_found(base_url: str) -> None:
    alice, bob = _client(base_url, "alice-key"), _client(base_url, "bob-key")
    running = alice.responses.create(model=DEFAULT_MODEL, input="hi", max_output_tokens=2000, background=True)
    unknown = _not_found(lambda: bob.responses.retrieve("resp_unknown"), "resp_unknown")
    assert _not_found(lambda: bob.responses.retrieve(running.id), running.id) == unknown
    assert _not_found(lambda: bob.responses.retrieve(running.id, stream=True), running.id) == unknown
    assert _not_found(lambda: bob.responses.cancel(running.id), running.id) == unknown
    assert alice.responses.retrieve(running.id).status == "in_progress"  # bob's cancel did nothing
    assert alice.responses.cancel(running.id).status == "cancelled"


def test_another_tenants_response_cannot_be_continued(base_url: str) -> None:
    alice, bob = _client(base_url, "alice-key"), _client(base_url, "bob-key")
    done = alice.responses.create(model=DEFAULT_MODEL, input="My name is Ada.", max_output_tokens=2)

    def continued(client: openai.OpenAI, previous: str):  # noqa: ANN202
        return lambda: client.responses.create(
            model=DEFAULT_MODEL, input="What is my name?", previous_response_id=previous, max_output_tokens=2
        )

    unknown = _not_found(continued(bob, "resp_unknown"), "resp_unknown")
    assert _not_found(continued(bob, done.id), done.id) == unknown
    assert continued(alice, done.id)().previous_response_id == done.id


def test_cache_salt_is_part_of_the_tenant(base_url: str) -> None:
    alice = _client(base_url, "alice-key")
    salted = alice.responses.create(
        model=DEFAULT_MODEL, input="hi", max_output_tokens=2, extra_body={"cache_salt": "user-7"}
    )
    assert _not_found(lambda: alice.responses.retrieve(salted.id), salted.id)  # the key alone is not the tenant
    again = alice.responses.retrieve(salted.id, extra_query={"cache_salt": "user-7"})
    assert again.id == salted.id and again.status == "incomplete"
    other = {"cache_salt": "user-8"}
    assert _not_found(lambda: alice.responses.retrieve(salted.id, extra_query=other), salted.id)


def test_prompt_cache_key_is_bounded(base_url: str) -> None:
    client = _client(base_url, "alice-key")
    long_key = "k" * (GatewaySettings().max_prompt_cache_key_chars + 1)
    with pytest.raises(openai.BadRequestError, match="max_prompt_cache_key_chars"):
        client.responses.create(model=DEFAULT_MODEL, input="hi", max_output_tokens=2, prompt_cache_key=long_key)
    with pytest.raises(openai.BadRequestError, match="max_prompt_cache_key_chars"):
        client.chat.completions.create(
            model=DEFAULT_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, prompt_cache_key=long_key
        )


def test_the_store_is_sent_one_turn_per_write() -> None:
    store = RecordingStore()
    with gateway(store) as url:
        client = _client(url, "alice-key")
        first = client.responses.create(model=DEFAULT_MODEL, input="one " * 200, max_output_tokens=2)
        second = client.responses.create(
            model=DEFAULT_MODEL, input="two", previous_response_id=first.id, max_output_tokens=2
        )
    first_write, second_write = store.writes
    turn = msgspec.json.decode(second_write.turn)
    assert [m["role"] for m in turn] == ["user", "assistant"] and turn[0]["content"] == "two"
    assert second_write.parent == first.id and second_write.response_id == second.id
    assert len(second_write.turn) < len(first_write.turn) / 10  # the first turn is not sent again
    whole = store.store.get(second.id, first_write.tenant)
    assert [m["content"] for m in whole.messages[::2]] == ["one " * 200, "two"]


def test_the_response_echoes_validated_fields_only(base_url: str) -> None:
    client = _client(base_url, "alice-key")
    junk = "x" * 20000  # a key no tool or format has: never used, so never kept or sent back
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}, "junk": junk}
    text = {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "junk": junk}}
    events = list(
        client.responses.create(
            model=DEFAULT_MODEL, input="hi", max_output_tokens=2, tools=[tool], text=text, stream=True,
            tool_choice="none",
        )
    )  # fmt: skip
    for event in (e for e in events if hasattr(e, "response")):
        dumped = json.dumps(event.response.model_dump())
        assert junk not in dumped
        assert event.response.tools[0].name == "f" and event.response.text.format.name == "s"


def test_each_tenant_key_is_its_own_tenant() -> None:
    """With one shared api_key every holder is one tenant; tenant_api_keys gives each key
    holder its own (the keys are all accepted, any other is a 401)."""
    with gateway(api_key="shared", tenant_api_keys=("alice-key", "bob-key")) as url:
        alice, bob, shared = (_client(url, k) for k in ("alice-key", "bob-key", "shared"))
        done = alice.responses.create(model=DEFAULT_MODEL, input="hi", max_output_tokens=2)
        assert alice.responses.retrieve(done.id).id == done.id
        for other in (bob, shared):
            assert _not_found(lambda: other.responses.retrieve(done.id), done.id)  # noqa: B023
        assert shared.responses.create(model=DEFAULT_MODEL, input="hi", max_output_tokens=2).status
        with pytest.raises(openai.AuthenticationError):
            _client(url, "mallory-key").responses.create(model=DEFAULT_MODEL, input="hi", max_output_tokens=2)
