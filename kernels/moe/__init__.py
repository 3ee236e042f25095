"""Mixture-of-experts kernels: routing, the grouped CPU path and the fused Triton kernel, and
the choice between them made once at load (choose.py)."""
