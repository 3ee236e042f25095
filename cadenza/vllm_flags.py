"""vLLM's command line, accepted as vLLM users type it (`cadenza serve MODEL -tp 2 --dtype
half --max-model-len 32k --enable-prefix-caching ...`): the positional model, vLLM's
spellings of values, and the vLLM flags that mean nothing here, taken with one warning line
rather than refused, so a vLLM command line runs unchanged."""

from __future__ import annotations

import argparse
import sys

# vLLM flags with no counterpart here: what each would have done is either Cadenza's default
# (chunked prefill, auto tool choice) or of no meaning on this engine (swap space, remote code).
IGNORED_FLAGS = {  # flag -> whether it takes a value
    "--enable-auto-tool-choice": False,
    "--enable-chunked-prefill": False,
    "--no-enable-chunked-prefill": False,
    "--disable-log-requests": False,
    "--enable-log-requests": False,
    "--disable-log-stats": False,
    "--trust-remote-code": False,
    "--disable-custom-all-reduce": False,
    "--swap-space": True,
    "--cpu-offload-gb": True,
    "--load-format": True,
    "--tokenizer-mode": True,
    "--distributed-executor-backend": True,
    "--max-num-partial-prefills": True,
    "--max-seq-len-to-capture": True,
}
DTYPE_ALIASES = {"half": "float16", "float": "float32", "fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def add_ignored_flags(p: argparse.ArgumentParser) -> None:
    for flag, takes_value in IGNORED_FLAGS.items():
        kwargs = {"nargs": "?", "const": True} if takes_value else {"action": "store_true"}
        p.add_argument(
            flag, dest="ignored_" + flag[2:].replace("-", "_"), default=None, help=argparse.SUPPRESS, **kwargs
        )


def warn_ignored(args: argparse.Namespace) -> None:
    """One line naming the vLLM flags given that mean nothing here."""
    given = [f for f in IGNORED_FLAGS if getattr(args, "ignored_" + f[2:].replace("-", "_"), None) not in (None, False)]
    if given:
        print(f"cadenza: ignoring vLLM flags that mean nothing here: {', '.join(given)}", file=sys.stderr)


def dtype_value(text: str) -> str:
    """vLLM's dtype spellings (half, float, ...) as ours."""
    return DTYPE_ALIASES.get(text, text)


def token_count(text: str) -> int:
    """A token count as vLLM reads one: 2048, 32k (32,000) or 32K (32,768), 1m / 1M."""
    units = {"k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a token count like 2048, 32k or 32K, got {text!r}") from None


def take_positional_model(args: argparse.Namespace) -> None:
    """`cadenza serve MODEL`: the positional model is --model (both given must agree)."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if args.model_given and args.model != tag:
        raise ValueError(f"the model is given twice: {tag!r} and --model {args.model!r}")
    args.model = tag
