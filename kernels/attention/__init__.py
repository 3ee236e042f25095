"""Paged attention: the torch reference, the CPU C kernel and the Triton kernels, behind dispatch.paged_attention."""
