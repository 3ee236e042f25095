"""The flags of `cadenza gpu-check`, apart from the check itself: the CLI builds its parser
in the gateway's process, which must not import torch (tests/gateway/test_torch_free.py)."""

from __future__ import annotations

import argparse

DTYPE_CHOICES = ("bf16", "fp16", "both")  # the keys of gpu_cases.DTYPES


def add_gpu_check_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `cadenza gpu-check` (and of `python -m cadenza.benchmarks.gpu_check`)."""
    parser.add_argument("--quick", action="store_true", help="fewer shapes and shorter timing runs")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="both")
    parser.add_argument("--budget-s", type=float, default=240.0, help="start no case after this many seconds")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (the only ones --device cpu runs)")
    parser.add_argument("--no-model", action="store_true", help="kernels only: skip the whole-model check")
