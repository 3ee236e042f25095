"""A chat request's tools: what the prompt shows, what constrains the output, what is parsed.

tool_choice `none` leaves the tools out of the prompt; `auto` shows them and parses the
reply (tool_calls.py); `required` constrains the reply to a JSON list of calls and a named
function to that function's arguments, by a grammar built from their JSON schemas. A
template that knows tools gets them (and tool turns) as transformers passes them; any other
is taught the hermes format in a system message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cadenza.gateway.json_scan import loads_bounded
from cadenza.gateway.request_error import RequestError
from cadenza.gateway.tool_calls import (
    MAX_CALL_JSON_DEPTH,
    StreamParser,
    ToolCall,
    call_as_text,
    hermes_system_prompt,
    parse,
    template_knows_tools,
)
from cadenza.structured_outputs import StructuredOutputs

ROLES = ("system", "user", "assistant", "developer", "tool")
ANY_OBJECT = {"type": "object"}


@dataclass(slots=True)
class ToolPlan:
    mode: str  # auto | required | named
    parser: str
    name: str | None = None  # the named function
    parallel: bool = True

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole reply: (content, calls). Grammar-made replies are calls by construction."""
        if self.mode == "named":
            return None, [ToolCall(self.name or "", text)]
        if self.mode == "required":
            return None, _listed_calls(text)
        content, calls = parse(self.parser, text)
        return content, calls if self.parallel else calls[:1]

    def stream_parser(self) -> StreamParser | None:
        return StreamParser(self.parser) if self.mode == "auto" else None


def plan(body: Any, parser: str) -> tuple[ToolPlan | None, list[dict[str, Any]]]:
    """(how the reply is read, the tools the prompt shows)."""
    tools = body.all_tools
    if any(t.type != "function" for t in tools):
        raise RequestError("only tools of type function are supported", "invalid_request", "tools")
    choice = body.requested_tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise RequestError("tool_choice needs tools", "invalid_request", "tool_choice")
        return None, []
    shown = [{"type": "function", "function": _function_dict(t.function)} for t in tools]
    parallel = body.parallel_tool_calls is not False
    if choice is None or choice == "auto":
        return ToolPlan("auto", parser, parallel=parallel), shown
    if choice == "none":
        return None, []
    if choice == "required":
        return ToolPlan("required", parser, parallel=parallel), shown
    name = _named(choice)
    if name not in {t.function.name for t in tools}:
        message = f"tool_choice names {name!r}, which is not among the tools"
        raise RequestError(message, "invalid_request", "tool_choice")
    return ToolPlan("named", parser, name=name), shown


def grammar(tool_plan: ToolPlan | None, body: Any) -> StructuredOutputs | None:
    if tool_plan is None or tool_plan.mode == "auto":
        return None
    functions = {t.function.name: t.function for t in body.all_tools}
    if tool_plan.mode == "named":
        function = functions[tool_plan.name]
        schema = function.parameters or ANY_OBJECT
        return _compiled(schema, bool(function.strict))
    calls = [_call_schema(f) for f in functions.values()]
    schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not tool_plan.parallel:
        schema["maxItems"] = 1
    return _compiled(schema, all(f.strict for f in functions.values()))


def messages(body: Any, shown: list[dict[str, Any]], template: str | None) -> tuple[list[dict], dict[str, Any]]:
    """The conversation as the template takes it, and the template variables for tools."""
    native = template_knows_tools(template)
    turns = [_turn(m, native) for m in body.messages]
    if native:
        return turns, ({"tools": shown} if shown else {})
    if shown:
        prompt = hermes_system_prompt(shown)
        if turns and turns[0]["role"] == "system":
            turns[0] = {**turns[0], "content": f"{turns[0]['content']}\n\n{prompt}"}
        else:
            turns.insert(0, {"role": "system", "content": prompt})
    return turns, {}


def _turn(m: Any, native: bool) -> dict[str, Any]:
    if m.role not in ROLES:
        raise RequestError(f"unsupported message role {m.role!r}", "invalid_request", "messages")
    content = _text(m.content)
    role = "system" if m.role == "developer" else m.role
    if native:
        turn: dict[str, Any] = {"role": role, "content": content}
        if m.tool_calls:
            turn["tool_calls"] = [_native_call(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            turn["tool_call_id"] = m.tool_call_id
        return turn
    if role == "tool":  # the hermes format's tool results, in a user turn any template renders
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    if m.tool_calls:
        written = [call_as_text(_native_call(c)) for c in m.tool_calls]
        content = "\n".join(([content] if content else []) + written)
    return {"role": role, "content": content}


def _text(content: Any) -> str:
    if isinstance(content, list):
        if any(p.type != "text" for p in content):
            raise RequestError("only text content parts are supported", "invalid_request", "messages")
        return "".join(p.text or "" for p in content)
    return content or ""


def _native_call(c: Any) -> dict[str, Any]:
    """transformers' shape: arguments as an object, as chat templates index into them."""
    try:
        arguments = loads_bounded(c.function.arguments or "{}", MAX_CALL_JSON_DEPTH)
    except ValueError:
        message = f"tool_calls arguments must be JSON nesting at most {MAX_CALL_JSON_DEPTH} levels"
        raise RequestError(message, "invalid_request", "messages") from None
    call = {"type": "function", "function": {"name": c.function.name, "arguments": arguments}}
    return {**call, "id": c.id} if c.id else call


def _function_dict(f: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"name": f.name, "parameters": f.parameters or ANY_OBJECT}
    if f.description:
        out["description"] = f.description
    return out


def _named(choice: Any) -> str:
    """{"type": "function", "function": {"name": ...}}, or the deprecated {"name": ...}."""
    picked = choice.get("function", choice) if isinstance(choice, dict) else None
    name = picked.get("name") if isinstance(picked, dict) else None
    if not isinstance(name, str):
        message = 'tool_choice must be none, auto, required or {"type": "function", "function": {"name": ...}}'
        raise RequestError(message, "invalid_request", "tool_choice")
    return name


def _call_schema(f: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": f.name}, "arguments": f.parameters or ANY_OBJECT},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _compiled(schema: Any, strict: bool) -> StructuredOutputs:
    try:
        return StructuredOutputs(json=schema, strict=strict, source="tools")
    except ValueError as e:
        raise RequestError(str(e), "invalid_request", "tools") from None


def _listed_calls(text: str) -> list[ToolCall]:
    try:
        items = loads_bounded(text, MAX_CALL_JSON_DEPTH)
    except ValueError:
        return []  # cut short (max_tokens): no complete call to report
    # The forced grammar requires both keys, but a reply is the model's: read it defensively.
    return [
        ToolCall(i["name"], json.dumps(i.get("arguments", {}), ensure_ascii=False))
        for i in items
        if isinstance(i, dict) and isinstance(i.get("name"), str)
    ]


class ToolDeltas:
    """One streamed choice's deltas under a tool plan: content as it comes, and each call
    as an OpenAI tool_calls delta (a named function's arguments stream as they are made)."""

    def __init__(self, tool_plan: ToolPlan) -> None:
        self.plan = tool_plan
        self.parser = tool_plan.stream_parser()
        self.held = ""  # required: the JSON list, read whole at the end
        self.count = 0  # calls sent so far
        self.sent: list[ToolCall] = []  # the parsed calls among them (a named one has none)

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.plan.mode == "named":
            return self._named_fragment(text)
        if self.parser is None:
            self.held += text
            return []
        content, calls = self.parser.feed(text)
        return self._deltas(content, calls)

    def finish(self) -> list[dict[str, Any]]:
        if self.parser is not None:
            return self._deltas(*self.parser.finish())
        if self.plan.mode == "required":
            return self._deltas("", _listed_calls(self.held))
        return []

    @property
    def called(self) -> bool:
        return self.count > 0

    def _named_fragment(self, text: str) -> list[dict[str, Any]]:
        if self.count == 0:  # the call opens with its id and name, then its arguments grow
            self.count = 1
            head = ToolCall(self.plan.name or "", "").to_openai(index=0)
            return [{"tool_calls": [head]}, *self._named_fragment(text)] if text else [{"tool_calls": [head]}]
        return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else []

    def _deltas(self, content: str | None, calls: list[ToolCall]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"content": content}] if content else []
        if not self.plan.parallel:
            calls = calls[: max(1 - self.count, 0)]
        for call in calls:
            out.append({"tool_calls": [call.to_openai(index=self.count)]})
            self.count += 1
            self.sent.append(call)
        return out
