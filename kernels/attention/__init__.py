"""Paged attention: the torch reference, the CPU C kernel and the Triton kernels, one per
backend in dispatch.PAGED_ATTENTION (a model's Kernels bundle binds one at load)."""
