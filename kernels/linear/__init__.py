"""How projections' weights are stored and multiplied: one LinearMethod per weight format,
picked per projection at load time by choose_linear_method (see base.py)."""

from cadenza.kernels.linear.base import LinearMethod
from cadenza.kernels.linear.choose import choose_linear_method
from cadenza.kernels.linear.dense import dense_linear

__all__ = ["LinearMethod", "choose_linear_method", "dense_linear"]
