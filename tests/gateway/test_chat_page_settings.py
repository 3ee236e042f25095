"""The chat page's settings panel (system prompt, temperature, top_p, max tokens) reaches the engine as
the Responses API's instructions, temperature, top_p and max_output_tokens, in headless Chromium."""

from __future__ import annotations

from typing import Any

import pytest
from cadenza_testkit.servers import PacedEngine, free_port, serve_in_thread

from cadenza.gateway.app import build_app
from cadenza.gateway.settings import GatewaySettings
from cadenza.models.loader import DEFAULT_MODEL


class RecordingEngine(PacedEngine):
    def __init__(self) -> None:
        super().__init__(0.0)
        self.seen: list[tuple[Any, Any]] = []

    async def generate(self, prompt: Any, params: Any, request_id: str, **kw: Any):  # noqa: ANN201
        self.seen.append((prompt, params))
        async for out in super().generate(prompt, params, request_id, **kw):
            yield out


@pytest.mark.slow
def test_the_settings_row_reaches_the_engine() -> None:
    from cadenza_testkit.browser import CHROMIUM_ARGS, chromium_path
    from playwright.sync_api import expect, sync_playwright

    engine, settings = RecordingEngine(), GatewaySettings(port=free_port())
    with serve_in_thread(build_app(engine, DEFAULT_MODEL, settings), settings.port), sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{settings.port}/")
            expect(page.locator("#status")).to_have_text("connected", timeout=30_000)
            page.click("#settings summary")  # the panel opens
            page.fill("#system", "Answer like a pirate.")
            page.fill("#temperature", "0.3")
            page.fill("#top_p", "0.9")
            page.fill("#max_tokens", "7")
            page.fill("#input", "Hello")
            page.keyboard.press("Enter")
            expect(page.locator(".msg.assistant .meta")).to_contain_text("TTFT", timeout=30_000)
        finally:
            browser.close()
    prompt, params = engine.seen[-1]
    assert (params.temperature, params.top_p, params.max_tokens) == (0.3, 0.9, 7)
    ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt.token_ids
    assert "Answer like a pirate." in engine.tokenizer.decode(ids, skip_special_tokens=False)
