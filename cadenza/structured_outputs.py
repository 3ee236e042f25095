"""StructuredOutputs: a request's output constrained by a grammar (vLLM's field names).

Exactly one of json (a JSON schema), json_object, regex, choice or grammar (Lark or GBNF).
Making one checks only its shape, never compiles: msgspec makes them while it decodes a
request body, on the gateway's event loop. `check()` compiles, once per distinct grammar in a
process (verdicts cached by `digest()`). Grammars are compiled by llguidance: it needs no
per-vocabulary preprocessing (a new schema costs about 1 ms, not a compile step), computes a
mask in ~0.06 ms a token for SmolLM2's 49k vocabulary, has no dependencies beyond its own
wheel, and can roll tokens back, which verifying speculative drafts needs. xgrammar
precompiles per schema and pulls in torch extensions and transformers; it gains nothing here.
"""

from __future__ import annotations

import hashlib
import json as jsonlib
import threading
from collections import OrderedDict
from typing import Any

import msgspec

# Compact JSON, the separators of json.dumps: with free whitespace a weak model can emit
# newlines forever inside a valid document and never close it.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = {"type": "object"}
# Distinct grammars whose verdict (valid, or the reason not) a process remembers.
VERDICT_CACHE_SIZE = 1024


class StructuredOutputs(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """What the output must match. strict=False compiles a JSON schema leniently: keywords
    the compiler does not implement are ignored, as OpenAI's non-strict mode does; strict
    schemas with such keywords are refused."""

    json: dict[str, Any] | bool | str | None = None  # a JSON schema (a string holds it serialised)
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or llama.cpp's GBNF
    strict: bool = True
    # Why the grammar exists, for error messages: "response_format", "tool_choice", ...
    source: str = "structured_outputs"

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"{self.source}: give exactly one of json, json_object, regex, choice, grammar")
        if isinstance(self.json, str):
            try:
                self.json = jsonlib.loads(self.json)
            except jsonlib.JSONDecodeError as e:
                raise ValueError(f"{self.source}: the JSON schema is not JSON: {e}") from None
        if self.json is True:  # the schema `true`: any JSON value
            self.json = {}
        if self.json is False:
            raise ValueError(f"{self.source}: the JSON schema `false` matches nothing")
        if self.choice is not None and not self.choice:
            raise ValueError(f"{self.source}: choice must list at least one string")

    def llguidance_grammar(self) -> str:
        """The grammar as llguidance's serialised form (what LLMatcher takes)."""
        from llguidance import LLMatcher, grammar_from

        if self.json is not None or self.json_object:
            schema = ANY_JSON_OBJECT if self.json_object else self.json
            options = {**COMPACT_JSON, "lenient": not self.strict}
            return LLMatcher.grammar_from_json_schema(schema, overrides=options)  # type: ignore[arg-type]
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return grammar_from("choice", self.choice)  # type: ignore[arg-type]
        return grammar_from("grammar", self.grammar or "")

    def digest(self) -> str:
        """The grammar's content hash: equal for equal grammars whatever asked for them (source
        is left out), so caches of verdicts and of compiled matchers are keyed by it."""
        content = [self.json, self.json_object, self.regex, self.choice, self.grammar, self.strict]
        return hashlib.sha256(msgspec.json.encode(content)).hexdigest()

    def check(self) -> None:
        """A grammar llguidance cannot compile is the request's error (HTTP 400), named here.
        Compiled once per distinct grammar in this process; later calls read the verdict."""
        digest = self.digest()
        problem = _VERDICTS.get(digest)
        if problem is None:
            problem = _VERDICTS.put(digest, self.compile_problem())
        if problem:
            raise ValueError(f"{self.source}: invalid {self.kind}: {problem}")

    def compile_problem(self) -> str:
        """Compile it, uncached: "" when valid, else llguidance's reason. llguidance bounds the
        work with its own budgets (LLParserLimits' defaults: 1M units of lexer fuel, ~20 ms of
        regex analysis; 500k grammar symbols); its time grows with the grammar's size
        (~0.5 s for 800 KB of schema on the 2-core host)."""
        try:
            return validate_grammar(self.llguidance_grammar()).strip()
        except (ValueError, TypeError) as e:
            return str(e).strip() or type(e).__name__

    @property
    def kind(self) -> str:
        if self.json is not None or self.json_object:
            return "JSON schema"
        return "regex" if self.regex is not None else "choice" if self.choice is not None else "grammar"


def validate_grammar(grammar: str) -> str:
    """llguidance's compile check of a serialised grammar: "" when valid, else why not (one
    seam, so tests can count compiles)."""
    from llguidance import LLMatcher

    return LLMatcher.validate_grammar(grammar)


class _Verdicts:
    """digest -> "" (valid) or the error message; least recently used dropped first. Shared by
    the threads of a process (the gateway compiles in worker threads)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._items: OrderedDict[str, str] = OrderedDict()

    def get(self, digest: str) -> str | None:
        with self._lock:
            if digest in self._items:
                self._items.move_to_end(digest)
            return self._items.get(digest)

    def put(self, digest: str, message: str) -> str:
        with self._lock:
            self._items[digest] = message
            self._items.move_to_end(digest)
            while len(self._items) > self._size:
                self._items.popitem(last=False)
        return message


_VERDICTS = _Verdicts(VERDICT_CACHE_SIZE)
