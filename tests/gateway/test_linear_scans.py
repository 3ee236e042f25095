"""Every check that reads client or model text runs in linear time, whatever the text.

The JSON pre-checks (nesting depth, integer size) and the tool-call parsers run on the event
loop, on bytes a client chose or made the model write. Adversarial generators (escaped
quotes with no closing quote, whitespace runs inside an unclosed tag, deep nesting, digit
runs) are timed against a benign text of the same length through the same function; the
budget is two orders of magnitude above that linear cost (the only kind of time bound a test
here states). The backtracking patterns these replaced cost 1.6 s at 8,000 escaped quotes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cadenza.gateway.json_scan import check_json, json_depth, loads_bounded
from cadenza.gateway.tool_calls import parse

BUDGET = 100  # x the benign cost at the same length
SIZE = 40_000  # big enough that a quadratic cost is thousands of times the linear one


def _best_of(fn: Callable[[], object], rounds: int = 3) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-5)  # below the timer's resolution, a floor rather than a zero


def _linear(check: Callable[[bytes | str], object], hostile: bytes | str, benign: bytes | str) -> None:
    def quiet(text: bytes | str) -> None:
        try:
            check(text)
        except ValueError:
            pass

    hostile_s, benign_s = _best_of(lambda: quiet(hostile)), _best_of(lambda: quiet(benign))
    assert hostile_s <= BUDGET * benign_s + 0.05, (hostile_s, benign_s)


# Units a hostile body repeats: each one breaks an unterminated string or nesting differently.
JSON_UNITS = st.sampled_from([b'\\"', b"\\\\", b'\\"\\\\', b"[", b"{", b'"a":[', b"1", b"-1", b" ", b"\\u00"])
PREFIXES = st.sampled_from([b'"', b'{"a": "', b"[", b'{"x": ', b""])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prefix=PREFIXES, unit=JSON_UNITS)
def test_json_checks_are_linear(prefix: bytes, unit: bytes) -> None:
    hostile = prefix + unit * (SIZE // len(unit))
    benign = b'{"a": "' + b"x" * (len(hostile) - 9) + b'"}'
    _linear(lambda raw: check_json(raw, 32), hostile, benign)  # type: ignore[arg-type]


def test_escaped_quotes_at_a_megabyte() -> None:
    """The body the limits allow (1 MiB) of `"` and `\\"`: once quadratic (hours), now one pass."""
    hostile = b'"' + b'\\"' * (1 << 19)
    benign = b'"' + b"a" * (1 << 20) + b'"'
    _linear(lambda raw: check_json(raw, 32), hostile, benign)  # type: ignore[arg-type]


TAG_UNITS = st.sampled_from([" ", "\n", "\t ", "<tool_call>", "<tool_", "{", '{"name": "f", "arguments": ', "["])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parser=st.sampled_from(["hermes", "llama3", "mistral"]), unit=TAG_UNITS)
def test_tool_call_parsers_are_linear(parser: str, unit: str) -> None:
    opening = {"hermes": "<tool_call>", "llama3": "{", "mistral": "[TOOL_CALLS]"}[parser]
    hostile = opening + unit * (SIZE // len(unit))
    benign = "x" * len(hostile)
    _linear(lambda text: parse(parser, text), hostile, benign)  # type: ignore[arg-type, return-value]


@pytest.mark.parametrize(
    "text,depth",
    [(b"", 0), (b"[]", 1), (b'[{"a": "[[[{{"}]', 2), (b'"unterminated [[[', 0), (b'"\\', 0), (b"[[[", 3), (b"]]][", 0)],
)
def test_depth_skips_strings_and_survives_malformed_input(text: bytes, depth: int) -> None:
    assert json_depth(text) == depth


@pytest.mark.parametrize(
    "body,ok",
    [
        (b'{"seed": 18446744073709551615}', True),
        (b'{"seed": -9223372036854775808}', True),
        (b'{"seed": 18446744073709551616}', False),
        (b'{"seed": -9223372036854775809}', False),
        (b'{"text": "123456789012345678901234567890"}', True),  # digits in a string are text
        (b'{"x": 1234567890123456789012.5}', True),  # a float, however long
        (b'{"x": 1e400}', True),
        (b'{"x": ' + b"9" * 5000 + b"}", False),
    ],
)
def test_integers_outside_64_bits_are_refused(body: bytes, ok: bool) -> None:
    if ok:
        check_json(body, 32)
    else:
        with pytest.raises(ValueError, match="does not fit in 64 bits"):
            check_json(body, 32)


def test_deep_model_json_is_text_not_a_recursion_error() -> None:
    """A reply nesting past Python's recursion limit: content, not a 500."""
    deep = "[" * 100_000
    for parser, text in (("hermes", f"<tool_call>{deep}</tool_call>"), ("llama3", "{" + '"a":[' * 5000)):
        content, calls = parse(parser, text)
        assert calls == [] and content == text
    with pytest.raises(ValueError, match="nests deeper"):
        loads_bounded(deep, 64)
