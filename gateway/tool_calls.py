"""Tool calling: tools into the prompt, calls out of the model's text.

With tool_choice `auto` the model's own output is parsed, by a parser for its family:
- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen, Hermes, and the
  format we teach a model whose template knows no tools, such as SmolLM2's);
- llama3: the reply is `{"name": ..., "parameters": {...}}` (`;` between several), maybe
  after `<|python_tag|>`;
- mistral: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}`.
`required` and a named function are constrained by a grammar instead (tool_choice.py), so
their arguments always match the function's schema.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from cadenza.gateway.json_scan import json_depth, loads_bounded

PARSERS = ("hermes", "llama3", "mistral")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
# Deepest nesting read from a call's JSON (the model's, or a client's earlier turn): Python's
# json recurses per level, and past this a call is text rather than a RecursionError.
MAX_CALL_JSON_DEPTH = 64


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def parser_for(template: str | None, configured: str = "auto") -> str:
    """The parser for a model: configured, else recognised from its chat template's markers."""
    if configured != "auto":
        if configured not in PARSERS:
            raise ValueError(f"tool_call_parser must be auto or one of {', '.join(PARSERS)}, got {configured!r}")
        return configured
    source = template or ""
    if MISTRAL_MARK in source:
        return "mistral"
    if PYTHON_TAG in source or "ipython" in source:
        return "llama3"
    return "hermes"


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template  # type: ignore[operator]


def hermes_system_prompt(tools: list[dict[str, Any]]) -> str:
    """How a model whose template knows no tools learns them: the hermes format, in words."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You can call functions to help with the user's request. They are described as JSON "
        f"inside <tools></tools>:\n<tools>\n{listed}\n</tools>\n"
        "To call one, answer with its name and a JSON object of arguments inside "
        '<tool_call></tool_call>, for example:\n<tool_call>\n{"name": "function_name", "arguments": {}}\n</tool_call>'
    )


def call_as_text(call: dict[str, Any]) -> str:
    """An assistant turn's earlier call, written back in the hermes format (for templates
    that cannot render tool_calls themselves)."""
    function = call.get("function") or {}
    arguments = function.get("arguments") or "{}"
    if isinstance(arguments, str):
        arguments = _json_or_text(arguments)
    body = json.dumps({"name": function.get("name", ""), "arguments": arguments}, ensure_ascii=False)
    return f"{HERMES_OPEN}\n{body}\n{HERMES_CLOSE}"


def parse(parser: str, text: str) -> tuple[str, list[ToolCall]]:
    """The reply's content and its calls; text that does not parse stays content."""
    if parser == "hermes":
        return _parse_hermes(text)
    if parser == "mistral":
        return _parse_mistral(text)
    return _parse_llama3(text)


def _parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """Finds each `<tool_call>` and the first `</tool_call>` after it with str.find, so the
    cost is linear in the text whatever the model wrote (a non-greedy pattern between the tags
    retried from every position of an unclosed call: cubic in a whitespace run)."""
    calls, kept, at = [], [], 0
    for start, end in _hermes_spans(text):
        call = _call(text[start + len(HERMES_OPEN) : end - len(HERMES_CLOSE)])
        if call is None:
            continue
        kept.append(text[at:start])
        at = end
        calls.append(call)
    kept.append(text[at:])
    return "".join(kept).strip() if calls else text, calls


def _hermes_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of each `<tool_call>...</tool_call>`; an open tag with no close ends the search."""
    spans, at = [], 0
    while (start := text.find(HERMES_OPEN, at)) >= 0:
        close = text.find(HERMES_CLOSE, start + len(HERMES_OPEN))
        if close < 0:
            break
        at = close + len(HERMES_CLOSE)
        spans.append((start, at))
    return spans


def _parse_mistral(text: str) -> tuple[str, list[ToolCall]]:
    content, mark, rest = text.partition(MISTRAL_MARK)
    if not mark:
        return text, []
    items = _json_or_none(rest.strip())
    calls = [c for c in (_call_from(i) for i in (items if isinstance(items, list) else [items])) if c]
    return (content.strip(), calls) if calls else (text, [])


def _parse_llama3(text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    calls = [_call(part) for part in _split_json_objects(body)]
    if not calls or any(c is None for c in calls):
        return text, []
    return "", calls  # type: ignore[return-value]


def _split_json_objects(body: str) -> list[str]:
    """`{...}; {...}` into its objects (raw_decode knows where each ends)."""
    if json_depth(body) > MAX_CALL_JSON_DEPTH:  # raw_decode would recurse past Python's limit
        return [body]
    decoder, parts, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            _, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return [body]
        parts.append(body[at:end])
        at = end
        while at < len(body) and body[at] in " \n\t;":
            at += 1
    return parts


def _call(raw: str) -> ToolCall | None:
    return _call_from(_json_or_none(raw))


def _call_from(item: Any) -> ToolCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _json_or_text(arguments)
    return ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False))


def _json_or_none(raw: str) -> Any:
    try:
        return loads_bounded(raw, MAX_CALL_JSON_DEPTH)
    except ValueError:  # a syntax error, or nesting past MAX_CALL_JSON_DEPTH
        return None


def _json_or_text(raw: str) -> Any:
    value = _json_or_none(raw)
    return raw if value is None else value


class StreamParser:
    """Streamed text in, content deltas and finished calls out. Content streams at once,
    except a tail that could begin a call marker: that waits until it is decided. A call is
    emitted whole once its text is complete (clients join argument fragments anyway)."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.buffer = ""  # undecided text
        self.in_call = False
        self.started = False  # any non-space text seen (llama3 calls are the whole reply)

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buffer += text
        if self.parser == "hermes":
            return self._feed_hermes()
        return self._feed_marked()

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end: what is still held back, as content or calls."""
        rest, self.buffer = self.buffer, ""
        if self.parser == "hermes" or not rest:
            return rest, []
        return parse(self.parser, rest)

    def _feed_hermes(self) -> tuple[str, list[ToolCall]]:
        content, calls = [], []
        while True:
            if self.in_call:
                end = self.buffer.find(HERMES_CLOSE)
                if end < 0:
                    break
                whole = self.buffer[: end + len(HERMES_CLOSE)]
                self.buffer, self.in_call = self.buffer[len(whole) :], False
                found, parsed = _parse_hermes(whole)
                calls += parsed
                content += [] if parsed else [found]
                continue
            start = self.buffer.find(HERMES_OPEN)
            if start < 0:
                keep = _marker_prefix_len(self.buffer, HERMES_OPEN)
                content.append(self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep :]
                break
            content.append(self.buffer[:start])
            self.buffer, self.in_call = self.buffer[start:], True
        return "".join(content), calls

    def _feed_marked(self) -> tuple[str, list[ToolCall]]:
        """llama3 and mistral: once a call may have begun, the rest waits for finish()."""
        if self.in_call:
            return "", []
        if self.parser == "llama3" and not self.started:
            head = self.buffer.lstrip()
            if not head or PYTHON_TAG.startswith(head[: len(PYTHON_TAG)]) or head.startswith("{"):
                self.in_call = bool(head) and (head.startswith("{") or head.startswith(PYTHON_TAG))
                return "", []
            self.started = True
        marker = MISTRAL_MARK if self.parser == "mistral" else None
        if marker is None:
            out, self.buffer = self.buffer, ""
            return out, []
        at = self.buffer.find(marker)
        if at >= 0:
            out, self.buffer, self.in_call = self.buffer[:at], self.buffer[at:], True
            return out, []
        keep = _marker_prefix_len(self.buffer, marker)
        out, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
        return out, []


def _marker_prefix_len(text: str, marker: str) -> int:
    """How long a tail of text could still grow into marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
