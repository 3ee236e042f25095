"""The checks that run on a JSON body or frame before any parser sees it, in linear time.

msgspec (like every recursive-descent parser) recurses per nesting level: a body of 5000
`[` makes it raise RecursionError, which is not a DecodeError and so escaped as a 500. And
msgspec decodes an integer of any size into a Python int, which then fails deep in the engine
(OverflowError packing a message) instead of here. Both checks need the body with its string
literals blanked out (a bracket or a digit inside a string is text), and both run on the event
loop before admission, on bytes the client chose: every pattern here is possessive, so no
input can make it backtrack. (The earlier pattern for a string literal retried from every
quote of an unterminated string: a body of `"` and many `\\"` cost the square of its length,
1.6 s for 8,000 of them, with every other connection stalled meanwhile.)
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

# A string literal; an unterminated one runs to the end (a parser refuses it later). Every
# quantifier is possessive and the branches cannot both match, so each byte is read once.
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)
# A JSON number without fraction or exponent, 19 digits or more: the only ones that can fall
# outside 64 bits.
_LONG_INTEGER = re.compile(rb"(?<![\d.eE+-])-?\d{19,}+(?![.eE])")
_INT_RANGE = (-(1 << 63), (1 << 64) - 1)  # int64 and uint64 (a seed may be either)
# Brackets as steps of the nesting depth: +1, and -1 as the int8 byte 0xff.
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class JsonDepthError(ValueError):
    """The JSON nests deeper than the limit allows."""


def without_strings(raw: bytes) -> bytes:
    """The JSON text with every string literal replaced by `""`."""
    return _STRING.sub(b'""', raw)


def json_depth(data: bytes | str) -> int:
    """The deepest array/object nesting in `data` (brackets inside strings do not count).
    Malformed input still gets a number; the parser that runs next reports the syntax error."""
    raw = data.encode() if isinstance(data, str) else data
    return _depth(without_strings(raw))


def check_json_depth(data: bytes | str, max_depth: int) -> None:
    """Raises ValueError naming the limit when `data` nests deeper than max_depth."""
    if json_depth(data) > max_depth:
        raise JsonDepthError(f"the JSON nests deeper than {max_depth} levels (max_json_depth)")


def check_json(raw: bytes, max_depth: int) -> None:
    """Both checks over one blanked copy: JsonDepthError for nesting past max_depth (named
    max_json_depth), ValueError for an integer outside int64/uint64."""
    bare = without_strings(raw)
    if _depth(bare) > max_depth:
        raise JsonDepthError(f"the JSON nests deeper than {max_depth} levels (max_json_depth)")
    _check_integers(bare)


def _depth(bare: bytes) -> int:
    steps = np.frombuffer(bare.translate(_STEPS, _NOT_BRACKETS), dtype=np.int8)
    # A running sum in C: a megabyte of brackets takes milliseconds (a Python loop, ~0.1 s).
    return int(steps.cumsum(dtype=np.int32).max(initial=0))


def _check_integers(bare: bytes) -> None:
    for match in _LONG_INTEGER.finditer(bare):
        digits = match.group()
        # int() of a 5000-digit string is itself refused by Python: length decides first.
        if len(digits.lstrip(b"-")) > 20 or not _INT_RANGE[0] <= int(digits) <= _INT_RANGE[1]:
            shown = digits[:24].decode() + ("..." if len(digits) > 24 else "")
            raise ValueError(f"the integer {shown} does not fit in 64 bits")


def loads_bounded(text: str, max_depth: int) -> Any:
    """json.loads for text a client or the model wrote (tool arguments, a reply's calls):
    Python's json recurses per level and raises RecursionError, which escaped as a 500, so
    nesting past max_depth is a ValueError (as a syntax error is) before it parses."""
    check_json_depth(text, max_depth)
    return json.loads(text)
