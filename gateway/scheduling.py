"""A request's place in the engine's queue: its priority and the conversation it belongs to.

Lower priority values run first (vLLM's convention), and under the default "priority"
policy a request at 0 is admitted before queued work at a higher number. A request says
its priority in its body (`priority`), else in an `x-priority` header (which Ray Serve's
proxy passes through), else OpenAI's `service_tier: "flex"` marks it batch work
(`batch_priority`); anything else is interactive (0).
"""

from __future__ import annotations

from typing import Any

from cadenza.gateway.request_error import RequestError

INTERACTIVE = 0
PRIORITY_HEADER = "x-priority"


def request_priority(body_priority: int | None, service_tier: str | None, headers: Any, batch_priority: int) -> int:
    if body_priority is not None:
        return body_priority
    header = headers.get(PRIORITY_HEADER) if headers is not None else None
    if header is not None:
        try:
            return int(header)
        except ValueError:
            raise RequestError(f"{PRIORITY_HEADER} must be an integer, got {header!r}", "invalid_request") from None
    return batch_priority if service_tier == "flex" else INTERACTIVE
