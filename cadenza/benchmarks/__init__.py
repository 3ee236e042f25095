"""Benchmarks printing JSON (`cadenza bench ...`) and the GPU acceptance check."""
