"""A nesting-depth check that runs before any JSON parser sees the body.

msgspec (like every recursive-descent parser) recurses per nesting level: a body of 5000
`[` makes it raise RecursionError, which is not a DecodeError and so escaped as a 500 (and
dropped the websocket without a close frame). One linear scan over the bytes is cheaper
than the parse it guards and needs no recursion.
"""

from __future__ import annotations

import re

# A JSON string literal (escapes included): its brackets are text, not nesting.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(data: bytes | str) -> int:
    """The deepest array/object nesting in `data` (brackets inside strings do not count).
    Malformed input still gets a number; the parser that runs next reports the syntax error."""
    raw = data.encode() if isinstance(data, str) else data
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    depth = deepest = 0
    for byte in brackets:
        depth += 1 if byte in b"[{" else -1
        deepest = max(deepest, depth)
    return deepest


def check_json_depth(data: bytes | str, max_depth: int) -> None:
    """Raises ValueError naming the limit when `data` nests deeper than max_depth."""
    if json_depth(data) > max_depth:
        raise ValueError(f"the JSON nests deeper than {max_depth} levels (max_json_depth)")
