"""Engine flags shared by every command (`cadenza generate/chat/serve/bench`), made from
EngineConfig's fields (cadenza/setting.py), and the EngineConfig keyword arguments they become."""

from __future__ import annotations

import argparse
import os

from cadenza.config import DEFAULT_MODEL, EngineConfig
from cadenza.setting import add_flags, values_from_args


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help=f"HF directory, .gguf file, Hub id (org/name) or packaged model name (default: {DEFAULT_MODEL})",
    )
    p.add_argument("--revision", default=None, help="a Hub id's branch, tag or commit (default: main)")
    p.add_argument("--download-dir", default=None, help="the Hub cache to read and fetch into (default: HF_HUB_CACHE)")
    add_flags(p, EngineConfig)
    # The spelling before vLLM's --no-enable-prefix-caching, kept so older command lines run.
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", help=argparse.SUPPRESS)


def apply_hub_flags(args: argparse.Namespace) -> None:
    """--revision and --download-dir as the environment the Hub lookup reads
    (cadenza/models/hub.py): the model is resolved in this process, the engine actor and its
    workers, which inherit it."""
    if getattr(args, "revision", None):
        os.environ["CADENZA_HUB_REVISION"] = args.revision
    if getattr(args, "download_dir", None):
        os.environ["HF_HUB_CACHE"] = args.download_dir


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine settings every command shares, from their flags."""
    return values_from_args(args, EngineConfig)
