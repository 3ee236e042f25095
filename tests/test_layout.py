"""The layout no package can shadow: pytest runs in importlib mode with no tests/__init__.py,
so the repository root is never on sys.path, and our top-level kernels/ (cadenza.kernels)
cannot stand in for an installed `kernels` (Hugging Face's, which transformers imports)."""

from __future__ import annotations

import sys
from importlib.machinery import PathFinder
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
OURS = ROOT / "kernels"


def test_the_repository_root_is_not_on_sys_path() -> None:
    assert ROOT not in [Path(p or ".").resolve() for p in sys.path]
    assert not (ROOT / "tests" / "__init__.py").exists()


def test_an_installed_kernels_package_wins_over_our_folder(tmp_path: Path) -> None:
    """`import kernels` as this process would do it, with another `kernels` installed after
    everything on sys.path (where site-packages sits): theirs is found, never ours."""
    theirs = tmp_path / "site-packages" / "kernels"
    theirs.mkdir(parents=True)
    (theirs / "__init__.py").write_text("")
    spec = PathFinder.find_spec("kernels", [*sys.path, str(theirs.parent)])
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).resolve().parent != OURS  # theirs (or the real one, when installed)


def test_transformers_imports_with_the_real_kernels_package() -> None:
    """transformers >= 5.25 imports Hugging Face's `kernels` when it is installed: that import
    must reach the installed package (it once hit our folder and failed)."""
    import transformers  # noqa: F401

    loaded = sys.modules.get("kernels")
    assert loaded is None or Path(loaded.__file__ or "/").resolve().parent != OURS


def test_only_the_three_required_folders_are_remapped() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {
        "cadenza": "cadenza",
        "cadenza.kernels": "kernels",
        "cadenza.actors": "actors",
        "cadenza.gateway": "gateway",
    }
    assert not any((ROOT / name).exists() for name in ("models", "cli", "benchmarks"))
