"""Where the examples find the server: `make serve`'s address unless CADENZA_BASE_URL says
otherwise, and the key `cadenza serve --api-key` (or $CADENZA_API_KEY) asks for."""

from __future__ import annotations

import os

BASE_URL = os.environ.get("CADENZA_BASE_URL", "http://127.0.0.1:8000/v1")
API_KEY = os.environ.get("CADENZA_API_KEY", "unused-unless---api-key")
MODEL = os.environ.get("CADENZA_MODEL", "SmolLM2-135M-Instruct")
