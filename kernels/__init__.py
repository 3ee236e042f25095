"""cadenza.kernels: the compute layer (ops bound per backend, attention, weight formats, C and
Triton kernels).

This folder is imported as `cadenza.kernels` (pyproject's package-dir). From the repository
root (`python -c`, `python -m ...`) Python can also find it under its bare folder name,
`kernels`, which is the name of Hugging Face's package that transformers imports. Imported by
that name, it steps aside: the installed `kernels` takes its place in sys.modules (the import
machinery returns what sys.modules holds after the module runs), or, with none installed, the
import fails as it would without this folder. tests/test_layout.py holds it to that.
"""

if __name__ == "kernels":
    import sys
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = PathFinder.find_spec("kernels", [p for p in sys.path if Path(p or ".").resolve() != root])
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError("No module named 'kernels'", name="kernels")
    installed = module_from_spec(spec)
    sys.modules["kernels"] = installed
    spec.loader.exec_module(installed)
