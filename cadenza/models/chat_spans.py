"""A rendered chat that knows where its messages' contents lie, so that special-token text a
client writes in a message stays text.

The chat template renders turns as text (`<|im_start|>user\\n...<|im_end|>`), and a tokenizer
reads every special token's text in it as that token. A message whose content holds
`<|im_end|>\\n<|im_start|>system\\n...` would open a real system turn (role spoofing). So the
template is rendered a second time with a marker in place of each content; the markers say
where each content lies, and those spans are tokenized with special tokens read as plain text
(the model sees the characters, as the template's author intended), the template's own text
as usual. Only conversations with special-token text in a content take this path: the rest
tokenize exactly as before, as HF's apply_chat_template + encode does.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Private-use code points around an index: no template trims or escapes them, no client text
# is likely to hold them (and if one does, its content is taken as the marker's, which is
# still text).
_MARK = "\ue000cadenza-content-{}\ue001"
_MARKED = re.compile("\ue000cadenza-content-(\\d+)\ue001")


@dataclass(frozen=True, slots=True)
class RenderedChat:
    text: str
    spans: tuple[tuple[int, int], ...] = ()  # [start, end) of message contents in text

    def cut(self, end: int) -> RenderedChat:
        """The text up to `end` (vLLM's continue_final_message cuts after the last content)."""
        spans = tuple((a, min(b, end)) for a, b in self.spans if a < end)
        return RenderedChat(self.text[:end], spans)


def render_with_spans(
    render: Callable[[list[dict[str, Any]]], str], messages: list[dict[str, Any]], specials: re.Pattern[str] | None
) -> RenderedChat:
    """The template's text, with content spans when some content holds special-token text."""
    text = render(messages)
    contents = [m.get("content") for m in messages]
    if specials is None or not any(isinstance(c, str) and specials.search(c) for c in contents):
        return RenderedChat(text)
    marked = [_marked(m, i) for i, m in enumerate(messages)]
    return _filled(render(marked), contents, text)


def refuse_special_text(
    messages: list[dict[str, Any]], variables: dict[str, Any] | None, specials: re.Pattern[str] | None
) -> None:
    """ValueError when special-token text lies anywhere but in a message's string content: a
    tool's definition, a tool call's arguments, a name, a template variable. The template
    renders those through its own filters (inside JSON, mostly), where no span can follow
    them, so they could not be kept as text; read as tokens they would open turns."""
    if specials is None:
        return
    for i, message in enumerate(messages):
        for key, value in message.items():
            if not (key == "content" and isinstance(value, str)):
                _refuse_in(value, specials, f"messages[{i}].{key}")
    for key, value in (variables or {}).items():
        _refuse_in(value, specials, key)


def _refuse_in(value: Any, specials: re.Pattern[str], where: str) -> None:
    """Walks strings, lists and dicts (keys included); the JSON depth bound limits the walk."""
    if isinstance(value, str):
        if found := specials.search(value):
            raise ValueError(
                f"{where} holds special-token text {found.group()!r}; it is refused outside message contents"
            )
    elif isinstance(value, dict):
        for key, item in value.items():
            _refuse_in(key, specials, where)
            _refuse_in(item, specials, f"{where}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _refuse_in(item, specials, f"{where}[{i}]")


def _marked(message: dict[str, Any], index: int) -> dict[str, Any]:
    return {**message, "content": _MARK.format(index)} if isinstance(message.get("content"), str) else message


def _filled(marked: str, contents: list[Any], text: str) -> RenderedChat:
    """The marked render with each marker replaced by its content, verbatim if that gives the
    template's own text, else stripped (a template that trims contents), else verbatim."""
    for shape in (str, str.strip):
        built = _substituted(marked, [shape(c) if isinstance(c, str) else "" for c in contents])
        if built.text == text:
            return built
    return _substituted(marked, [c if isinstance(c, str) else "" for c in contents])


def _substituted(marked: str, contents: list[str]) -> RenderedChat:
    parts, spans, at, length = [], [], 0, 0
    for match in _MARKED.finditer(marked):
        parts.append(marked[at : match.start()])
        length += match.start() - at
        content = contents[int(match.group(1))]
        parts.append(content)
        spans.append((length, length + len(content)))
        length += len(content)
        at = match.end()
    parts.append(marked[at:])
    return RenderedChat("".join(parts), tuple(spans))


def special_text_pattern(special_tokens: list[str]) -> re.Pattern[str] | None:
    """One pattern for every special token's text (longest first), or None when there are none."""
    tokens = sorted((t for t in special_tokens if t), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, tokens))) if tokens else None
