"""The layout no package can shadow: pytest runs in importlib mode with no tests/__init__.py,
so the repository root is never on sys.path, and our top-level kernels/ (cadenza.kernels)
cannot stand in for an installed `kernels` (Hugging Face's, which transformers imports), not
even from the repository root, where Python finds the folder by its bare name."""

from __future__ import annotations

import os
import subprocess
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


def test_every_package_folder_ships_in_the_wheel() -> None:
    """setuptools lists the packages by name: a folder of modules left off the list works in
    this checkout (an editable install finds it) and is missing from the built wheel."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for package, folder in config["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *relative.parts]))
    assert found - set(config["packages"]) == set()


def _from_the_root(code: str, *flags: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`python -c code` run in the repository root, so sys.path[0] is the root itself."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(
        [sys.executable, *flags, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_from_the_repository_root_import_kernels_is_the_installed_one(tmp_path: Path) -> None:
    theirs = tmp_path / "kernels"
    theirs.mkdir()
    (theirs / "__init__.py").write_text("WHOSE = 'theirs'\n")
    (theirs / "layers.py").write_text("")  # a submodule resolves inside their package
    done = _from_the_root(
        "import kernels, kernels.layers; print(kernels.WHOSE, kernels.layers.__file__)", pythonpath=tmp_path
    )
    assert done.returncode == 0, done.stderr
    whose, submodule = done.stdout.split()
    assert whose == "theirs" and Path(submodule).resolve().parent == theirs.resolve()


def test_from_the_repository_root_with_none_installed_import_kernels_fails_as_without_us() -> None:
    done = _from_the_root("import sys; sys.path.insert(0, ''); import kernels", "-S")  # -S: no site-packages
    assert done.returncode == 1 and "ModuleNotFoundError: No module named 'kernels'" in done.stderr


def test_from_the_repository_root_transformers_gets_the_real_package() -> None:
    done = _from_the_root("import transformers, kernels; print(kernels.__file__)")
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).resolve().parent != OURS
