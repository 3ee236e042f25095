"""A request's grammar from whichever field asked for one: OpenAI's response_format (and the
Responses API's text.format), vLLM's structured_outputs, or its older guided_* fields."""

from __future__ import annotations

from typing import Any

from cadenza.gateway.request_error import RequestError
from cadenza.structured_outputs import StructuredOutputs


def requested_grammar(body: Any) -> StructuredOutputs | None:
    """At most one source; none, or response_format text, means free text."""
    found = [(name, g) for name, g in _sources(body) if g is not None]
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise RequestError(f"ask for one output format, not several ({names})", "invalid_request", found[1][0])
    return found[0][1] if found else None


def _sources(body: Any) -> list[tuple[str, StructuredOutputs | None]]:
    return [
        ("response_format", from_response_format(body.response_format)),
        ("structured_outputs", body.structured_outputs),
        ("guided_json", _guided(json=body.guided_json)),
        ("guided_regex", _guided(regex=body.guided_regex)),
        ("guided_choice", _guided(choice=body.guided_choice)),
        ("guided_grammar", _guided(grammar=body.guided_grammar)),
    ]


def _guided(**field: Any) -> StructuredOutputs | None:
    name, value = next(iter(field.items()))
    if value is None:
        return None
    return _build(f"guided_{name}", **field)


def from_response_format(fmt: Any) -> StructuredOutputs | None:
    """response_format {type: text | json_object | json_schema, json_schema: {...}}."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return _build("response_format", json_object=True)
    if fmt.type == "json_schema":
        spec = fmt.json_schema
        if spec is None or spec.schema is None:
            message = "response_format json_schema needs json_schema.schema"
            raise RequestError(message, "invalid_request", "response_format")
        return _build("response_format", json=spec.schema, strict=bool(spec.strict))
    message = f"response_format type must be text, json_object or json_schema, got {fmt.type!r}"
    raise RequestError(message, "invalid_request", "response_format")


def from_text_format(text: dict[str, Any] | None) -> StructuredOutputs | None:
    """The Responses API's text: {format: {type, name, schema, strict}} (flat, unlike chat's)."""
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type", "text") == "text":
        return None
    if fmt.get("type") == "json_object":
        return _build("text.format", json_object=True)
    if fmt.get("type") == "json_schema" and fmt.get("schema") is not None:
        return _build("text.format", json=fmt["schema"], strict=bool(fmt.get("strict")))
    raise RequestError("text.format must be text, json_object, or json_schema with a schema", "invalid_request", "text")


def _build(source: str, **fields: Any) -> StructuredOutputs:
    try:
        return StructuredOutputs(source=source, **fields)
    except ValueError as e:
        raise RequestError(str(e), "invalid_request", source.split(".")[0]) from None


def combined(fmt: StructuredOutputs | None, calls: StructuredOutputs | None) -> StructuredOutputs | None:
    """The reply's grammar: an output format, or the calls tool_choice requires (not both)."""
    if fmt is not None and calls is not None:
        message = "tool_choice required or a named function already fixes the reply; drop the output format"
        raise RequestError(message, "invalid_request", "tool_choice")
    return fmt or calls
