"""The CPU backend's C kernels (kernels/csrc): build, bindings and the tensor-level calls."""
