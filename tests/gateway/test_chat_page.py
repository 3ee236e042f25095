"""The chat page at / in headless Chromium (Debian's), driven through Playwright."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import pytest
from cadenza_testkit.browser import CHROMIUM_ARGS, chromium_path
from cadenza_testkit.servers import API_KEY, ARTIFACTS


@contextlib.contextmanager
def _connected_page(server) -> Iterator:  # noqa: ANN001 - the gateway conftest's Server
    """The chat page in headless Chromium, its websocket connected."""
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            # The page runs under its Content-Security-Policy: anything it blocks is a bug.
            blocked: list[str] = []
            page.on("console", lambda m: blocked.append(m.text) if "Content Security Policy" in m.text else None)
            page.goto(f"{server.http}/?key={API_KEY}")
            expect(page.locator("#status")).to_have_text("connected", timeout=30_000)
            yield page
            assert not blocked, blocked
        finally:
            browser.close()


@pytest.mark.slow
def test_chat_page_streams_two_turns_and_stops(server) -> None:
    from playwright.sync_api import expect

    with _connected_page(server) as page:
        stored = server.get("/stats")["gateway"]["stored_responses"]

        for turn, question in enumerate(["What is 2 + 2?", "And what is 3 + 3?"], start=1):
            page.fill("#input", question)
            page.keyboard.press("Enter")
            reply = page.locator(".msg.assistant").nth(turn - 1)
            expect(reply.locator(".meta")).to_contain_text("TTFT", timeout=120_000)
            assert len(reply.inner_text()) > len(reply.locator(".meta").inner_text())
        expect(page.locator(".msg.user")).to_have_count(2)
        assert server.get("/stats")["gateway"]["stored_responses"] >= stored + 2

        page.fill("#input", "Write a very long story about a castle and its many rooms.")
        page.keyboard.press("Enter")
        reply = page.locator(".msg.assistant").nth(2)
        expect(reply).to_contain_text(re.compile(r"\w+\W+\w+\W+\w+"), timeout=120_000)  # words streamed in
        page.click("#stop")
        expect(reply.locator(".meta")).to_contain_text("cancelled", timeout=30_000)
        assert len(reply.inner_text()) > len(reply.locator(".meta").inner_text()) + 10
        expect(page.locator("#send")).to_be_enabled()
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "chat_page.png"), full_page=True)
    assert (ARTIFACTS / "chat_page.png").stat().st_size > 0


WEATHER_TOOL = (
    '[{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": '
    '{"city": {"type": "string", "maxLength": 20}}, "required": ["city"], "additionalProperties": false}}]'
)


@pytest.mark.slow
def test_chat_page_json_mode_and_tool_call_cards(server) -> None:
    import json

    from playwright.sync_api import expect

    with _connected_page(server) as page:
        page.click("#settings summary")  # the settings panel opens
        page.check("#json")
        page.fill("#input", "Describe a cat in JSON.")
        page.keyboard.press("Enter")
        reply = page.locator(".msg.assistant").nth(0)
        expect(reply.locator(".meta")).to_contain_text("TTFT", timeout=120_000)
        if "incomplete" not in reply.locator(".meta").inner_text():
            assert isinstance(json.loads(page.evaluate("current.items[1].text")), dict)
        page.uncheck("#json")
        page.fill("#tools", WEATHER_TOOL)
        page.select_option("#tool_choice", "required")
        page.fill("#input", "What is the weather in Paris?")
        page.keyboard.press("Enter")
        # "required" allows parallel calls: the model may call the tool more than once (a card
        # each); any one result continues the conversation.
        card = page.locator(".card").first
        expect(card.locator(".name")).to_contain_text("get_weather", timeout=120_000)
        assert all("get_weather" in name for name in page.locator(".card .name").all_inner_texts())
        assert "city" in json.loads(card.locator("pre").inner_text())
        expect(page.locator("#send")).to_be_enabled(timeout=60_000)
        page.select_option("#tool_choice", "auto")
        card.locator("input").fill('{"temperature_c": 18}')
        card.locator("button").click()
        # The tool-calling turn shows as its card (its reply was empty); the answer follows the result.
        answer = page.locator(".msg.assistant").nth(1)
        expect(answer.locator(".meta")).to_contain_text("TTFT", timeout=120_000)
        page.screenshot(path=str(ARTIFACTS / "chat_page_tools.png"), full_page=True)


@pytest.mark.slow
def test_chat_page_resumes_after_a_forced_socket_close(server) -> None:
    from playwright.sync_api import expect

    with _connected_page(server) as page:
        page.fill("#input", "Write a long story about a castle and its many rooms.")
        page.keyboard.press("Enter")
        reply = page.locator(".msg.assistant").nth(0)
        expect(reply).to_contain_text(re.compile(r"\w+\W+\w+\W+\w+"), timeout=120_000)
        page.evaluate("ws.close()")  # the network drops mid-reply
        expect(reply.locator(".meta")).to_contain_text("TTFT", timeout=180_000)
        response_id = page.evaluate("previousId")
        shown = page.evaluate("current.items[1].text").rstrip("\n")  # the markdown source the page kept
        stored = server.get(f"/v1/responses/{response_id}")
        # Nothing lost, nothing repeated. Trailing newlines aside: the page's text drops them,
        # and a sampled reply may end on some.
        assert stored["output"][0]["content"][0]["text"].rstrip("\n") == shown
        expect(page.locator("#status")).to_have_text("connected", timeout=30_000)


@pytest.mark.slow
def test_leaving_the_page_cancels_its_background_response(server) -> None:
    """Background responses outlive their socket (for resume), so the page cancels its own
    when the tab closes or navigates away."""
    import time

    from playwright.sync_api import expect

    with _connected_page(server) as page:
        page.fill("#input", "Write a very long story about a castle and its many rooms.")
        page.keyboard.press("Enter")
        reply = page.locator(".msg.assistant").nth(0)
        expect(reply).to_contain_text(re.compile(r"\w+\W+\w+"), timeout=120_000)
        response_id = page.evaluate("active.id")
        page.goto("about:blank")
        deadline = time.monotonic() + 60  # hang guard only
        while server.get(f"/v1/responses/{response_id}")["status"] == "in_progress" and time.monotonic() < deadline:
            time.sleep(0.2)
    assert server.get(f"/v1/responses/{response_id}")["status"] == "cancelled"
