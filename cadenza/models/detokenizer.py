"""Incremental detokenization whose pieces always concatenate to decode(all ids)."""

from __future__ import annotations

from cadenza.models.tokenizer import Tokenizer

# Byte-level BPE can split one character over several tokens; a decoded window then ends in
# U+FFFD until the rest arrives, so such text is held back.
_PARTIAL = "\ufffd"


class IncrementalDetokenizer:
    """Decodes a growing id list window by window.

    The text of ids[prefix:read] was already emitted; each step decodes ids[prefix:] and emits
    what lies past it. Decoding from a token boundary a few tokens back keeps tokenizers whose
    decoders look at neighbours (SentencePiece's leading-space strip) consistent.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids)
        # Start the window a few prompt tokens back so the first output token decodes in context.
        self.prefix = max(len(self.ids) - 5, 0)
        self.read = len(self.ids)
        self.num_prompt = len(prompt_ids)
        self.text = ""

    def add(self, new_ids: list[int]) -> str:
        """Append ids; return the newly complete text (may be empty)."""
        self.ids.extend(new_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of the request: emit whatever is held back, partial characters included."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        before = self.tokenizer.decode(self.ids[self.prefix : self.read], self.skip)
        if self.read == self.num_prompt:
            # The prompt's last token may end in the first bytes of a character that the first
            # output token completes: that character was never emitted, so it belongs to the
            # output (without this it was lost: `after` is then no longer than `before`).
            before = before.rstrip(_PARTIAL)
        after = self.tokenizer.decode(self.ids[self.prefix :], self.skip)
        if len(after) <= len(before) or (after.endswith(_PARTIAL) and not final):
            return ""
        delta = after[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return delta
