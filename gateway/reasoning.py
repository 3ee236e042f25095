"""Reasoning models' thinking, read apart from their answer (vLLM's `--reasoning-parser`):
`<think> ... </think>` text goes to the message's `reasoning_content`, the rest to `content`.

    qwen3        reasoning only where the reply opens with <think> (Qwen3, QwQ; a reply whose
                 template turned thinking off has none, and is all content)
    deepseek_r1  the reply starts inside reasoning (DeepSeek-R1 and its distills put <think> in
                 the prompt), which runs until </think>; an opening <think> is dropped too

Text comes in pieces (streamed deltas), so a tag may be split across them: the splitter holds
back only what could still be the start of a tag (fewer characters than the tag), which keeps
the work linear in the reply (issue #38's rule for every scan of model text)."""

from __future__ import annotations

from cadenza.models.chat_template import render_chat
from cadenza.outputs import CompletionOutput

OPEN, CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


def parser_for(template: str | None, configured: str) -> str:
    """The parser for a model ("" for none): configured, else recognised from its chat
    template. A template whose generation prompt leaves the reply inside <think> (DeepSeek-R1's
    distills) reads as deepseek_r1; one that otherwise writes <think> (Qwen3, QwQ) as qwen3."""
    if configured != "auto":
        return "" if configured == "none" else configured
    if not template or OPEN not in template:
        return ""
    try:
        prompt = render_chat(template, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    except ValueError:  # a template that needs more than a plain turn: its markers still say
        prompt = ""
    return "deepseek_r1" if prompt.rstrip().endswith(OPEN) else "qwen3"


class ReasoningSplitter:
    """One choice's reply, fed piece by piece: each piece's (reasoning, content)."""

    def __init__(self, parser: str) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {parser!r}")
        self.parser = parser
        self.state = "start"  # start -> reasoning -> content, or start -> content
        self.held = ""  # a possible tag's beginning, not yet given out
        self.eat_newlines = False  # the newlines right after a tag are the template's, not text

    @property
    def thinking(self) -> bool:
        return self.state == "reasoning" or (self.state == "start" and self.parser == "deepseek_r1")

    def feed(self, text: str) -> tuple[str, str]:
        text, self.held = self.held + text, ""
        if self.state == "start":
            text = self._opening(text)
            if self.state == "start":  # still undecided: all of it may be an opening tag
                return "", ""
        if self.state == "content":
            return "", self._eat(text)
        end = text.find(CLOSE)
        if end >= 0:
            self.state = "content"
            reasoning = self._eat(text[:end])
            self.eat_newlines = True
            return reasoning, self._eat(text[end + len(CLOSE) :])
        keep = _partial_tail(text, CLOSE)
        self.held = text[len(text) - keep :]
        return self._eat(text[: len(text) - keep]), ""

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the reply: an unclosed tag's start is text."""
        held, self.held = self._eat(self.held), ""
        if self.state == "start":
            return (held, "") if self.parser == "deepseek_r1" else ("", held)
        return (held, "") if self.state == "reasoning" else ("", held)

    def _opening(self, text: str) -> str:
        """Decide from the reply's start whether it opens with <think> (leading whitespace aside)."""
        stripped = text.lstrip()
        if stripped.startswith(OPEN):
            self.state, self.eat_newlines = "reasoning", True
            return stripped[len(OPEN) :]
        if OPEN.startswith(stripped):  # "", "<", "<th", ...: wait for more
            self.held = text
            return ""
        self.state = "reasoning" if self.parser == "deepseek_r1" else "content"
        return text

    def _eat(self, text: str) -> str:
        if self.eat_newlines:
            text = text.lstrip("\n")
            self.eat_newlines = not text
        return text


def _partial_tail(text: str, tag: str) -> int:
    """How many trailing characters of `text` are a proper prefix of `tag` (so may be its start)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class ReasoningTally:
    """A request's choices split as their deltas arrive, once, for everything that reads them:
    each delta's (reasoning, content) for its chunk, each choice's whole split for the message,
    and the thinking's tokens for the usage (a delta that opens or closes the thinking counts)."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.splitters: dict[int, ReasoningSplitter] = {}
        self.latest: dict[int, tuple[str, str]] = {}
        self.whole: dict[int, tuple[str, str]] = {}
        self.tokens = 0

    def add(self, out: CompletionOutput) -> None:
        splitter = self.splitters.setdefault(out.index, ReasoningSplitter(self.parser))
        was_thinking = splitter.thinking
        reasoning, content = splitter.feed(out.text)
        if out.finish_reason:
            more_reasoning, more_content = splitter.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        if was_thinking or splitter.thinking:
            self.tokens += len(out.token_ids)
        self.latest[out.index] = (reasoning, content)
        before = self.whole.get(out.index, ("", ""))
        self.whole[out.index] = (before[0] + reasoning, before[1] + content)


def split_whole(parser: str, text: str) -> tuple[str, str]:
    """A whole reply's (reasoning, content)."""
    splitter = ReasoningSplitter(parser)
    reasoning, content = splitter.feed(text)
    tail_reasoning, tail_content = splitter.finish()
    return reasoning + tail_reasoning, content + tail_content
