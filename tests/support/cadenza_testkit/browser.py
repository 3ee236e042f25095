"""Debian's headless Chromium for the chat-page tests (Playwright's own browsers are not used)."""

from __future__ import annotations

import shutil

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "headless Chromium is needed: apt-get install chromium (make test does it)"
    return path
