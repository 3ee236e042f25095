"""The chat page people like, in headless Chromium: markdown rendered (and sanitised), code
highlighted, conversations kept in the browser and listed in the sidebar (a reload keeps
them), each turn sending the whole conversation, regenerate, copy; screenshots for docs/."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from cadenza_testkit.servers import ARTIFACTS, PacedEngine, free_port, serve_in_thread

from cadenza.gateway.app import build_app
from cadenza.gateway.settings import GatewaySettings
from cadenza.models.loader import DEFAULT_MODEL
from cadenza.outputs import CompletionOutput, RequestMetrics, RequestOutput

REPLY = (
    "Here is **a function** with `inline code`:\n\n"
    "```python\ndef add_one(x):\n    return x + 1\n```\n\n"
    "| a | b |\n| --- | --- |\n| 1 | 2 |\n\n"
    '<img src="x" onerror="window.pwned = 1"> [a link](https://example.com)\n'
)


class ScriptedEngine(PacedEngine):
    """Streams REPLY in small pieces, recording every prompt it is given."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self.seen: list[tuple[Any, Any]] = []

    async def generate(self, prompt: Any, params: Any, request_id: str, **_: Any) -> AsyncIterator[RequestOutput]:
        self.seen.append((prompt, params))
        pieces = [REPLY[i : i + 7] for i in range(0, len(REPLY), 7)]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            out = CompletionOutput(0, piece, [42], None, None, "stop" if last else None)
            yield RequestOutput(
                request_id, None, [], None, [out], last, 0, [RequestMetrics(time.time(), queue_time=0.0)]
            )

    def prompt_text(self, index: int = -1) -> str:
        prompt = self.seen[index][0]
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt.token_ids
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def _send(page: Any, text: str, turn: int) -> Any:
    from playwright.sync_api import expect

    page.fill("#input", text)
    page.keyboard.press("Enter")
    reply = page.locator(".msg.assistant").nth(turn)
    expect(reply.locator(".meta")).to_contain_text("TTFT", timeout=30_000)
    return reply


@pytest.mark.slow
def test_markdown_conversations_regenerate_and_copy() -> None:
    from cadenza_testkit.browser import CHROMIUM_ARGS, chromium_path
    from playwright.sync_api import expect, sync_playwright

    engine, settings = ScriptedEngine(), GatewaySettings(port=free_port())
    url = f"http://127.0.0.1:{settings.port}/"
    with serve_in_thread(build_app(engine, DEFAULT_MODEL, settings), settings.port), sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1100, "height": 760})
            context.grant_permissions(["clipboard-read", "clipboard-write"], origin=url.rstrip("/"))
            page = context.new_page()
            blocked: list[str] = []
            page.on("console", lambda m: blocked.append(m.text) if "Content Security Policy" in m.text else None)
            page.goto(url)
            expect(page.locator("#status")).to_have_text("connected", timeout=30_000)
            reply = _send(page, "Show me a function", 0)
            # Markdown: the bold, the table and the link render; HTML shows as text, its handler never runs.
            expect(reply.locator("strong")).to_have_text("a function")
            expect(reply.locator("table td").first).to_have_text("1")
            assert reply.locator("a").get_attribute("rel") == "noopener noreferrer"
            assert page.evaluate("window.pwned") is None and reply.locator("img").count() == 0
            expect(reply).to_contain_text('<img src="x" onerror=')
            # Code highlighted by highlight.js.
            expect(reply.locator("pre code.hljs .hljs-keyword").first).to_have_text("def")
            expect(page.locator("#convs li")).to_have_count(1)
            expect(page.locator("#convs li span")).to_have_text("Show me a function")
            page.screenshot(path=str(ARTIFACTS / "chat_page_markdown.png"))

            # A reload keeps the conversation, rendered again, and the next turn sends all of it.
            page.reload()
            expect(page.locator("#status")).to_have_text("connected", timeout=30_000)
            expect(page.locator(".msg.user")).to_have_text(["Show me a function"])
            expect(page.locator(".msg.assistant pre code.hljs")).to_have_count(1)
            _send(page, "And another", 1)
            sent = engine.prompt_text()
            assert "Show me a function" in sent and "add_one" in sent and "And another" in sent

            # Regenerate asks again with the same conversation and replaces the last reply.
            asked = len(engine.seen)
            page.locator(".msg.assistant").nth(1).locator(".regenerate").click()
            expect(page.locator(".msg.assistant").nth(1).locator(".meta")).to_contain_text("TTFT", timeout=30_000)
            assert len(engine.seen) == asked + 1 and engine.prompt_text() == engine.prompt_text(-2)
            expect(page.locator(".msg.assistant")).to_have_count(2)

            # Copy puts the reply's markdown source on the clipboard.
            page.locator(".msg.assistant").nth(0).locator(".copy").click()
            expect(page.locator(".msg.assistant").nth(0).locator(".copy")).to_have_text("Copied")
            assert page.evaluate("navigator.clipboard.readText()") == REPLY

            # A new chat, listed first; the old one is a click away.
            page.click("#reset")
            expect(page.locator("#convs li")).to_have_count(2)
            expect(page.locator(".msg")).to_have_count(0)
            page.locator("#convs li", has_text="Show me a function").click()
            expect(page.locator(".msg.user")).to_have_count(2)
            page.screenshot(path=str(ARTIFACTS / "chat_page_conversations.png"))
            assert not blocked, blocked
        finally:
            browser.close()
