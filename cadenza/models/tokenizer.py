"""Tokenizer: HF `tokenizers` built from tokenizer.json or from a GGUF's vocabulary."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from cadenza.models.chat_spans import RenderedChat, refuse_special_text, render_with_spans, special_text_pattern
from cadenza.models.chat_template import render_chat
from cadenza.models.gguf_file import GGUFFile
from cadenza.models.gguf_reader import field_value
from cadenza.models.spm_gguf import sentencepiece_bpe

# Pre-tokenizer split patterns by llama.cpp's `tokenizer.ggml.pre` name (the patterns each
# model family's reference tokenizer uses).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


class Tokenizer:
    """Text <-> ids, special tokens and the chat template of one model."""

    def __init__(
        self,
        backend: HFTokenizer,
        chat_template: str | None,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        add_bos: bool,
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos = add_bos  # prepend BOS ourselves (GGUF); tokenizer.json post-processors do their own
        added = backend.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self._special_text = special_text_pattern([t.content for t in added.values() if t.special])
        self._as_text: HFTokenizer | None = None  # a copy that reads special-token text as text

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_text(self, token_id: int) -> str:
        return self.backend.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        variables: dict[str, Any] | None = None,
    ) -> str:
        """variables: extra template variables (vLLM's chat_template_kwargs), e.g. a switch the
        model's template reads; they cannot replace the ones set here."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass a plain prompt instead")
        reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token"} & set(variables or {})
        if reserved:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(sorted(reserved))}")
        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt,
            bos_token=self._text(self.bos_token_id),
            eos_token=self._text(self._first_eos()),
            **(variables or {}),
        )

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        variables: dict[str, Any] | None = None,
    ) -> RenderedChat:
        """apply_chat_template's text, with where the contents lie when one holds special-token
        text (models/chat_spans.py: such text stays text when encode_chat tokenizes it).
        ValueError for special-token text anywhere else (tools, tool calls, variables)."""
        refuse_special_text(messages, variables, self._special_text)
        render = lambda turns: self.apply_chat_template(turns, add_generation_prompt, variables)  # noqa: E731
        return render_with_spans(render, messages, self._special_text)

    def encode_chat(self, chat: RenderedChat, add_special_tokens: bool = False) -> list[int]:
        """A rendered chat's ids: the template's text as encode() reads it, the contents' spans
        with special tokens read as text."""
        if not chat.spans:
            return self.encode(chat.text, add_special_tokens)
        if self._as_text is None:
            self._as_text = HFTokenizer.from_str(self.backend.to_str())
            self._as_text.encode_special_tokens = True
        ids, at = self.encode("", add_special_tokens), 0  # the BOS a post-processor or add_bos puts first
        for start, end in chat.spans:
            ids += self.backend.encode(chat.text[at:start], add_special_tokens=False).ids
            ids += self._as_text.encode(chat.text[start:end], add_special_tokens=False).ids
            at = end
        return ids + self.backend.encode(chat.text[at:], add_special_tokens=False).ids

    def _first_eos(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def _text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.id_to_token(token_id) or "")

    @classmethod
    def from_hf_dir(cls, directory: Path, eos_token_ids: tuple[int, ...]) -> Tokenizer | None:
        """None when the directory has no tokenizer.json (token-id-only use, as in tests)."""
        path = directory / "tokenizer.json"
        if not path.is_file():
            return None
        backend = HFTokenizer.from_file(str(path))
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        bos = _token_id(backend, config.get("bos_token"))
        eos = eos_token_ids or tuple(i for i in [_token_id(backend, config.get("eos_token"))] if i is not None)
        return cls(backend, _hf_chat_template(directory, config), bos, eos, add_bos=False)

    @classmethod
    def from_gguf(cls, reader: GGUFFile, path: Path, eos_token_ids: tuple[int, ...]) -> Tokenizer:
        kind = field_value(reader, "tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise ValueError(
                f"{path}: unsupported GGUF tokenizer {kind!r}; "
                "supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece)"
            )
        tokens = field_value(reader, "tokenizer.ggml.tokens")
        types = field_value(reader, "tokenizer.ggml.token_type") or []
        if kind == "llama":  # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says not to
            backend = sentencepiece_bpe(
                tokens, field_value(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens), types
            )
            add_bos_default = True
        else:
            merges = field_value(reader, "tokenizer.ggml.merges") or []
            try:
                backend = _byte_level_bpe(tokens, merges, types, field_value(reader, "tokenizer.ggml.pre", "default"))
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None
            add_bos_default = False
        return cls(
            backend,
            field_value(reader, "tokenizer.chat_template"),
            field_value(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids,
            add_bos=bool(field_value(reader, "tokenizer.ggml.add_bos_token", add_bos_default)),
        )


def _hf_chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates; "default" is the chat one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _token_id(backend: HFTokenizer, token: Any) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if isinstance(token, str) else None


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable}
    chars.update({b: chr(256 + i) for i, b in enumerate(extra)})
    return chars


@lru_cache(maxsize=1)
def _byte_alphabet_chars() -> frozenset[str]:
    return frozenset(_byte_alphabet().values())


def _spell(token: str) -> str:
    """Tokens in a byte-level vocabulary are spelled in the byte alphabet; respell stray raw text."""
    if _byte_alphabet_chars().issuperset(token):
        return token
    alphabet = _byte_alphabet()
    return "".join(alphabet[b] for b in token.encode("utf-8"))


def _byte_level_bpe(tokens: list[str], merges: list[str], types: list[int], pre: str) -> HFTokenizer:
    vocab = {_spell(t): i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in ("llama-bpe", "llama3")))
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    backend.add_special_tokens(control)
    backend.add_tokens(user)
    return backend


# `tokenizer.ggml.pre` names whose reference split is GPT-2's own regex (ByteLevel's).
_GPT2_SPLIT_NAMES = ("default", "gpt2", "gpt-2")


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The split a GGUF's `tokenizer.ggml.pre` names. An unknown name is an error: falling back
    to GPT-2's regex would give different tokens from the model's own tokenizer, silently."""
    known = (*_SPLITS, "smollm", *_GPT2_SPLIT_NAMES)
    if pre not in known:
        raise ValueError(f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}; supported: {sorted(known)}")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in _SPLITS)
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"), byte_level])
    if pre == "smollm":  # SmolLM's reference tokenizer splits digits one by one before GPT-2's regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level
