"""Resolve a model name to files and load config, weights and tokenizer."""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from cadenza.config import DEFAULT_MODEL  # noqa: F401 - this module's API
from cadenza.models.config import ModelConfig
from cadenza.models.fused_checkpoint import FUSED_CHECKPOINT_ARCHITECTURES, split_fused
from cadenza.models.gguf_loader import iter_gguf_tensors, open_gguf, read_gguf_config
from cadenza.models.llama import LlamaForCausalLM
from cadenza.models.model_files import (  # noqa: F401 - this module's API
    PACKAGED_MODELS,
    load_tokenizer,
    max_model_len,
    read_model,
    resolve_model_path,
)
from cadenza.models.safetensors_loader import iter_safetensors, read_hf_config
from cadenza.models.tokenizer import Tokenizer
from cadenza.models.weights import ModelPart, build_model
from cadenza.weight_format import WeightFormat

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    config: ModelConfig
    model: LlamaForCausalLM
    # Built on first use: a worker needs it only for grammars, and a 49k vocabulary holds ~37 MB
    # (measured on SmolLM2's GGUF) that an engine which never sees a grammar need not keep.
    load_tokenizer: Callable[[], Tokenizer | None]
    max_model_len: int

    @functools.cached_property
    def tokenizer(self) -> Tokenizer | None:
        return self.load_tokenizer()


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
        tensors = iter_safetensors(path)
    else:
        reader = open_gguf(path)
        cfg = read_gguf_config(reader, path)
        tensors = iter_gguf_tensors(reader, cfg, path, keep=fmt.keep_gguf)
    if cfg.architecture in FUSED_CHECKPOINT_ARCHITECTURES:
        tensors = split_fused(tensors, cfg)
    length = max_model_len(cfg, max_len)
    model = build_model(cfg, tensors, fmt, device, length, part)
    model.weights_label = weights_label(model, fmt)
    log.info(
        "%s: weights as %s, computing in %s (many-row GEMMs in %s)",
        name, model.weights_label, fmt.compute_dtype, fmt.gemm_dtype,
    )  # fmt: skip
    return LoadedModel(cfg, model, functools.partial(load_tokenizer, path, cfg), length)


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
