"""Helpers for the deploy tests."""

from __future__ import annotations

import json
import socket
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_tiny_chat_model(directory: Path) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and chat template, saved in `directory`:
    fast to load twice."""
    import torch
    import transformers

    from cadenza.models.loader import DEFAULT_MODEL, load_tokenizer, read_model

    tok = load_tokenizer(*read_model(DEFAULT_MODEL))
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tok.backend.save(str(directory / "tokenizer.json"))
    eos = tok.id_to_token(tok.eos_token_ids[0])
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": tok.chat_template, "eos_token": eos}))
    return directory
