"""A request's place in the engine's queue: its priority and the conversation it belongs to.

Lower priority values run first (vLLM's convention), and under the default "priority"
policy a request at 0 is admitted before queued work at a higher number. A request says
its priority in its body (`priority`), else in an `x-priority` header (which Ray Serve's
proxy passes through), else OpenAI's `service_tier: "flex"` marks it batch work
(`batch_priority`); anything else is interactive (0).

Body and header share one range, [MIN_PRIORITY, MAX_PRIORITY]; outside it is a 400 (an
unbounded header once reached the engine as an integer past 64 bits: a 500). Priorities
below interactive are for the keys the operator names (`priority_api_keys`): anyone else
asking for one gets a 400, as vLLM answers a priority it will not honour. Whatever the
priority, the engine ages waiting work (EngineConfig.priority_aging_s), so none starves.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from cadenza.gateway.request_error import RequestError
from cadenza.request_limits import presented_keys

if TYPE_CHECKING:
    from cadenza.gateway.settings import GatewaySettings

INTERACTIVE = 0
PRIORITY_HEADER = "x-priority"
# Room for any tiering a deployment wants, and bounded so that aging bounds every wait: at
# priority_aging_s a level, nothing newer overtakes a request once it has waited (its
# priority - MIN_PRIORITY) levels' worth.
MIN_PRIORITY, MAX_PRIORITY = -1000, 1000
_INTEGER = re.compile(r"\s*[+-]?[0-9]{1,20}\s*")  # int() would also take "1_000" and 4000 digits


def request_priority(
    body_priority: int | None, service_tier: str | None, headers: Any, settings: GatewaySettings
) -> int:
    """The priority a request asked for (body, then header, then service_tier), checked."""
    header = headers.get(PRIORITY_HEADER) if headers is not None else None
    if body_priority is not None:
        priority = _in_range(body_priority, "priority", body_priority, param="priority")
    elif header is not None:
        value = int(header) if _INTEGER.fullmatch(header) else None
        priority = _in_range(value, PRIORITY_HEADER, header[:40])
    else:
        return settings.batch_priority if service_tier == "flex" else INTERACTIVE
    if priority < INTERACTIVE and not settings.grants_priority(presented_keys(headers or {})):
        message = (
            f"priority {priority} would go ahead of interactive work ({INTERACTIVE}): "
            "only an API key named in the server's priority_api_keys may ask for it"
        )
        raise RequestError(message, "priority_not_allowed", "priority")
    return priority


def _in_range(value: int | None, name: str, asked: object, param: str | None = None) -> int:
    if value is None or not MIN_PRIORITY <= value <= MAX_PRIORITY:
        bounds = f"[{MIN_PRIORITY}, {MAX_PRIORITY}]"
        raise RequestError(f"{name} must be an integer in {bounds} (lower runs first), got {asked!r}", param=param)
    return value
