"""Helpers the tests share: tiny models, test servers and engines, kernel criteria, oracles.

On sys.path through pytest's `pythonpath` (pyproject.toml), alone in its folder, so no test
folder (tests/actors, tests/kernels, ...) ever becomes an importable package that could shadow
an installed one."""
