"""A SentencePiece GGUF vocabulary (`tokenizer.ggml.model = llama`) tokenizes as transformers'
own GGUF reader does on the same file: merges by score, byte fallback for what the vocabulary
lacks, whitespace runs, control tokens kept whole, the round trip back to text."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from cadenza.models.gguf_reader import open_gguf
from cadenza.models.tokenizer import Tokenizer

SPACE = "\u2581"
PIECES = [
    "the", "he", "th", SPACE + "the", SPACE + "th", SPACE + "t", "in", SPACE + "in", "ing", "an", "at",
    SPACE + "a", "st", SPACE + "s", "on", "or", "ld", "lo", "ll", "llo", "hel", SPACE + "hel", SPACE + "hello",
    SPACE + "w", SPACE + "wor", SPACE + "world", "wor", SPACE + SPACE, SPACE * 4, "er", "ca", SPACE + "ca",
]  # fmt: skip
CHARS = [SPACE, *"abcdefghijklmnopqrstuvwxyz,."]
TEXTS = [
    "hello world, the cat sat in the string.",
    "  leading spaces,   runs    of them and a tail  ",
    "Ünïcode ☃ and UPPER case fall back to bytes\nnew lines\ttabs",
    "<s>the control token stays whole</s> in text",
    "",
]


def _sentencepiece_gguf(path: Path) -> Path:
    """A tiny Llama-2-style vocabulary: <unk>, <s>, </s>, the 256 byte tokens, single
    characters, then merged pieces; scores fall with the id, as SentencePiece writes them."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *CHARS, *PIECES]
    types = [2, 3, 3, *[6] * 256, *[1] * (len(CHARS) + len(PIECES))]
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 64), (writer.add_embedding_length, 8),
                       (writer.add_feed_forward_length, 16), (writer.add_head_count, 2)):  # fmt: skip
        add(value)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - (ours, transformers')
    from transformers import AutoTokenizer

    path = _sentencepiece_gguf(tmp_path_factory.mktemp("spm") / "vocab.gguf")
    ours = Tokenizer.from_gguf(open_gguf(path), path, (2,))
    return ours, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_gguf_encodes_and_decodes_as_transformers(tokenizers, text: str) -> None:
    ours, hf = tokenizers
    ids = ours.encode(text)
    assert ids == hf.encode(text)  # BOS first: llama.cpp's default for SentencePiece
    assert ids[0] == 1
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_missing_characters_fall_back_to_their_bytes(tokenizers) -> None:
    ours, _ = tokenizers
    snowman = ours.encode("☃", add_special_tokens=False)
    byte_ids = [3 + b for b in "☃".encode()]
    assert snowman[-3:] == byte_ids and ours.decode(snowman) == "☃"
