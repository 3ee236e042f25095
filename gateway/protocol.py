"""OpenAI Responses over WebSocket: the client events we accept (msgspec, validated on decode)
and builders for the server events we send, shaped as the `openai` package's models.

Client events: `response.create` (the POST /v1/responses fields at top level, plus the
lane `stream_id`), `response.steer`, and Cadenza's `response.cancel`. Fields we do not
use (metadata, reasoning, ...) are ignored, as the REST API ignores what a model cannot do.
Function tools and text.format work as in chat completions (gateway/tool_choice.py).
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import msgspec

Json = dict[str, Any]
EXTRA_KEY = "cadenza"  # namespaced extras on server events; OpenAI clients keep and ignore them
# msgspec decodes any JSON integer into a Python int; the engine's messages carry int64.
MAX_INT = 2**63 - 1


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class InputMessage(msgspec.Struct):
    """An input item: a message, or a function call and its output (tool turns)."""

    role: str | None = None
    content: str | list[ContentPart] | None = None
    type: str = "message"
    call_id: str | None = None  # function_call / function_call_output
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


Input = str | list[InputMessage]


class ResponseCreate(msgspec.Struct, tag="response.create", tag_field="type"):
    model: str | None = None
    input: Input | None = None
    instructions: str | None = None
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_INT)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    previous_response_id: str | None = None
    stream_id: str | None = None
    cache_salt: str | None = None  # vLLM's: mixed into the prefix-cache hashes with the tenant's key
    text: dict[str, Any] | None = None  # {"format": {"type": "json_schema", "schema": ...}}
    tools: list[dict[str, Any]] | None = None  # {"type": "function", "name", "parameters", ...}
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Runs on when its stream drops (the socket closes): resumable by GET
    # /v1/responses/{id}?stream=true&starting_after=N, cancelled only by a cancel.
    background: bool = False
    stream: bool = False  # POST /v1/responses only (the websocket always streams)
    priority: Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)] | None = None  # lower runs first
    service_tier: str | None = None  # "flex": batch work (gateway/scheduling.py)
    prompt_cache_key: str | None = None  # the conversation (default: the previous_response_id chain's)


class ResponseSteer(msgspec.Struct, tag="response.steer", tag_field="type"):
    previous_response_id: str
    input: Input


class ResponseCancel(msgspec.Struct, tag="response.cancel", tag_field="type"):
    response_id: str


ClientEvent = ResponseCreate | ResponseSteer | ResponseCancel
_decoder = msgspec.json.Decoder(ClientEvent)
encode = msgspec.json.Encoder().encode


def decode_client_event(frame: str | bytes) -> ClientEvent:
    """Raises ValueError with a message that names the bad field. Check the frame's depth
    first (json_scan.check_json): msgspec recurses per nesting level."""
    try:
        return _decoder.decode(frame)
    except RecursionError:  # a belt behind the depth check: this must never end the socket
        raise ValueError("malformed event: nested too deeply") from None
    except msgspec.DecodeError as e:
        if "Invalid value" in str(e) and "$.type" in str(e):
            raise ValueError(f"unknown event type: {e}") from None
        raise ValueError(f"malformed event: {e}") from None


def input_count(value: Input | None) -> int:
    """Messages in a client input (a string is one), checked against max_messages."""
    if value is None:
        return 0
    return 1 if isinstance(value, str) else len(value)


def input_messages(value: Input | None) -> list[Json]:
    """Client input as chat messages: a string is one user message; parts are joined; a
    function_call item is an assistant turn's tool call (consecutive ones share the turn), a
    function_call_output a tool turn, as chat completions has them."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[Json] = []
    for m in value:
        if m.type == "function_call":
            _add_call(messages, m)
        elif m.type == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": m.call_id, "content": m.output or ""})
        else:
            messages.append(_message(m))
    return messages


def _message(m: InputMessage) -> Json:
    if m.type != "message":
        raise ValueError(f"unsupported input item type {m.type!r}: message, function_call or function_call_output")
    if m.role not in ("user", "assistant", "system", "developer"):
        raise ValueError(f"unsupported input role {m.role!r}")
    if isinstance(m.content, str) or m.content is None:
        text = m.content or ""
    else:
        bad = [p.type for p in m.content if p.type not in ("input_text", "output_text", "text")]
        if bad:
            raise ValueError(f"unsupported content part type {bad[0]!r}: this server takes text only")
        text = "".join(p.text or "" for p in m.content)
    return {"role": "system" if m.role == "developer" else m.role, "content": text}


def _add_call(messages: list[Json], m: InputMessage) -> None:
    if not m.name:
        raise ValueError("a function_call input item needs a name")
    call = {"id": m.call_id, "type": "function", "function": {"name": m.name, "arguments": m.arguments or "{}"}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and "tool_calls" in last:
        last["tool_calls"].append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> Json:
    return {
        "id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
        "status": status,
    }  # fmt: skip


_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}


def error_object(message: str, code: str, status: int, param: str | None = None, **extra: Any) -> Json:
    """OpenAI's error shape, shared by the websocket `error` event and HTTP error bodies."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"type": kind, "code": code, "message": message, "param": param, **extra}


def error_event(message: str, code: str, status: int = 400, param: str | None = None, **extra: Any) -> Json:
    return {"type": "error", "status": status, "error": error_object(message, code, status, param, **extra)}


def response_object(
    response_id: str,
    model: str,
    status: str,
    create: ResponseCreate,
    output: list[Json],
    created_at: float,
    **fields: Any,
) -> Json:
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(created_at),
        "model": model,
        "status": status,
        "output": output,
        "parallel_tool_calls": create.parallel_tool_calls is not False and bool(create.tools),
        "tool_choice": create.tool_choice or ("auto" if create.tools else "none"),
        "tools": create.tools or [],
        "text": create.text or {"format": {"type": "text"}},
        "background": create.background,
        "instructions": create.instructions,
        "previous_response_id": create.previous_response_id,
        "max_output_tokens": create.max_output_tokens,
        "temperature": create.temperature,
        "top_p": create.top_p,
        **fields,
    }


def message_item(item_id: str, text: str, status: str) -> Json:
    content = [text_part(text)] if status != "in_progress" else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def text_part(text: str) -> Json:
    return {"type": "output_text", "text": text, "annotations": []}


def reasoning_item(item_id: str, text: str, status: str) -> Json:
    """A reasoning model's thinking (the reasoning parser's split), as open-weight models'
    Responses output carries it: reasoning_text content, no summary."""
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def usage(input_tokens: int, cached_tokens: int, output_tokens: int, reasoning_tokens: int = 0) -> Json:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


def now() -> float:
    return time.time()
