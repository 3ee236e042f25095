"""Tokenizer, chat template and incremental detokenization on SmolLM2's GGUF vocabulary."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from cadenza.models.detokenizer import IncrementalDetokenizer
from cadenza.models.gguf_loader import open_gguf
from cadenza.models.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "日本語のテキストと中文字符",
    "emoji: 🎉🚀👩‍💻 and accents: café, naïve",
    "  leading spaces\nnew lines\n\n\ttabs",
    "<|im_start|>user\nhi<|im_end|>",
    "def f(x):\n    return x ** 2  # comment",
]


@pytest.fixture(scope="module")
def tokenizer(smollm_path) -> Tokenizer:
    return Tokenizer.from_gguf(open_gguf(smollm_path), smollm_path, (2,))


@pytest.fixture(scope="module")
def hf_tokenizer(smollm_path):  # noqa: ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_path.parent, gguf_file=smollm_path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_matches_transformers(tokenizer: Tokenizer, hf_tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)


def test_chat_template_matches_transformers(tokenizer: Tokenizer, hf_tokenizer) -> None:
    conversations = [
        [{"role": "user", "content": "Hi there"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"},
        ],
    ]
    for messages in conversations:
        for gen in (True, False):
            ours = tokenizer.apply_chat_template(messages, add_generation_prompt=gen)
            assert ours == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


def test_chat_template_errors_are_value_errors(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="role"):
        tokenizer.apply_chat_template([{"content": "no role"}])


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenization_concatenates_to_decode(tokenizer: Tokenizer, skip: bool) -> None:
    rng = random.Random(0)
    prompt = tokenizer.encode("Prompt: ")
    cases = [tokenizer.encode(t) for t in TEXTS]
    # Random ids too: arbitrary byte-level pieces, partial UTF-8 sequences, special tokens.
    cases += [[rng.randrange(tokenizer.vocab_size) for _ in range(60)] for _ in range(20)]
    for ids in cases:
        detok = IncrementalDetokenizer(tokenizer, prompt, skip)
        pieces = [detok.add([i]) for i in ids] + [detok.flush()]
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in p for p in pieces[:-1] if p) or "\ufffd" in tokenizer.decode(ids, skip)


def test_multibyte_character_is_held_back(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1  # one emoji, several byte-level tokens
    detok = IncrementalDetokenizer(tokenizer, [], True)
    assert [detok.add([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "🎉"


def test_a_character_split_between_prompt_and_output_is_kept(tokenizer: Tokenizer) -> None:
    """The prompt's last token holds the first bytes of 🎉, the first output token the rest:
    the character belongs to the output (it used to be lost)."""
    ids = tokenizer.encode("Party 🎉 time")
    split = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer, ids[:split], True)
    text = "".join(detok.add([i]) for i in ids[split:]) + detok.flush()
    assert text.startswith("🎉") and text.endswith(" time")
    assert tokenizer.decode(ids[:split]).rstrip("\ufffd") + text == "Party 🎉 time"


def _tokenizer_gguf(path: Path, pre: str) -> Path:
    """A GGUF holding only a byte-level BPE vocabulary (no tensors) with the given pre name."""
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "ab", "<|end|>"])
    writer.add_token_merges(["a b"])
    writer.add_token_types([1, 1, 1, 3])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_with_an_unknown_pre_tokenizer_is_refused_not_guessed(tmp_path: Path) -> None:
    """An unknown `tokenizer.ggml.pre` once fell back to GPT-2's split silently (wrong tokens)."""

    known = Tokenizer.from_gguf(open_gguf(_tokenizer_gguf(tmp_path / "ok.gguf", "llama-bpe")), tmp_path, (3,))
    assert known.encode("ab", add_special_tokens=False) == [2]
    path = _tokenizer_gguf(tmp_path / "odd.gguf", "mystery-pre")
    with pytest.raises(ValueError, match=r"odd.gguf.*tokenizer.ggml.pre='mystery-pre'; supported: \["):
        Tokenizer.from_gguf(open_gguf(path), path, (3,))
