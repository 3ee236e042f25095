"""A GGUF's SentencePiece vocabulary (`tokenizer.ggml.model = llama`: Llama 2, Mistral 7B,
Phi-3) as an HF `tokenizers` BPE with byte fallback.

A SentencePiece BPE model keeps no merge list: it merges, at each step, the adjacent pair
whose joined piece scores highest. The same ranking as BPE merges: every way to cut each
normal piece into two pieces of the vocabulary, ordered by the whole piece's score (ties:
shorter left piece first), which is how `tokenizers`' own SentencePiece converters read a
model. Text is spelled with U+2581 for spaces and one prepended to the first word
(Metaspace), pieces missing from the vocabulary fall back to their UTF-8 bytes (<0x..>
tokens), and the decoder undoes both. `tokenizers` does the encoding (no sentencepiece or
transformers at run time); transformers' own GGUF reader is the test's oracle.
"""

from __future__ import annotations

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# llama.cpp's token types.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"


def sentencepiece_bpe(tokens: list[str], scores: list[float], types: list[int]) -> HFTokenizer:
    types = types or [NORMAL] * len(tokens)
    vocab = {token: i for i, token in enumerate(tokens)}
    unk = next((t for t, k in zip(tokens, types) if k == UNKNOWN), None)
    model = models.BPE(
        vocab=vocab, merges=_merges(tokens, scores, types, vocab), unk_token=unk, fuse_unk=True, byte_fallback=True
    )
    backend = HFTokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    )
    return backend


def _merges(tokens: list[str], scores: list[float], types: list[int], vocab: dict[str, int]) -> list[tuple[str, str]]:
    ranked: list[tuple[float, int, str, str]] = []
    for token, score, kind in zip(tokens, scores, types):
        if kind != NORMAL:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, cut, left, right))
    ranked.sort(key=lambda merge: (merge[0], merge[1]))
    return [(left, right) for _, _, left, right in ranked]
