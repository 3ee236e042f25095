"""Chat templates rendered the way transformers renders them, in a sandbox."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # transformers' filter keeps non-ASCII text as is; jinja's default would escape it.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_chat(
    template: str, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **variables: Any
) -> str:
    """The prompt text for `messages`; a template error becomes a ValueError naming the cause."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"message {i} must be a dict with a 'role' (and usually 'content')")
    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
    except TemplateError as e:
        raise ValueError(f"chat template failed: {e}") from e
