"""The built wheel ships kernels/csrc, and an installed copy (not this checkout) builds and loads
the C kernels from it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from cadenza.kernels.cpu import bindings

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).parents[2]
CHECK = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import torch

    import cadenza.kernels
    from cadenza.kernels import ops
    from cadenza.kernels.cpu import bindings, build

    venv = Path(sys.argv[1]).resolve()
    for module in (cadenza.kernels, build):
        assert venv in Path(module.__file__).resolve().parents, module.__file__
    assert venv in build.SOURCES.resolve().parents and (build.SOURCES / "cadenza_kernels.h").is_file()
    missing = [f.name for f in bindings.FUNCTIONS if not f.available()]
    assert not missing, f"not built: {missing}"
    assert ops.default_backend() == ("triton" if torch.cuda.is_available() else "cpu")
    print("ok")
    """
)


def _copy_sources(destination: Path) -> None:
    """The files the wheel is built from, so the build writes nothing into this checkout."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, destination / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    for folder in set(project["tool"]["setuptools"]["package-dir"].values()):
        shutil.copytree(ROOT / folder, destination / folder, ignore=ignore)


@pytest.mark.slow
def test_an_installed_wheel_builds_and_loads_the_c_kernels(tmp_path: Path) -> None:
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler: the kernels cannot be built here")
    source, dist, venv = tmp_path / "source", tmp_path / "dist", tmp_path / "venv"
    source.mkdir()
    _copy_sources(source)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", dist, source], check=True)
    (wheel,) = dist.glob("cadenza-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True
        ).strip()
    )
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", site, wheel], check=True)
    # torch and the rest come from this environment's site-packages, added after the venv's own,
    # so the wheel's cadenza is found first (a .pth path line runs none of that directory's
    # .pth files, so this checkout's editable finder stays out).
    (site / "outer.pth").write_text(sysconfig.get_path("purelib") + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CADENZA_KERNELS")}
    env["CADENZA_CACHE_DIR"] = str(tmp_path / "cache")  # a fresh build, from the wheel's sources
    done = subprocess.run(
        [python, "-c", CHECK, venv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
    # One shared library per library the bindings name (a .c file may be #included by another).
    libraries = {f.library for f in bindings.FUNCTIONS}
    built = {path.name.rsplit("-", 1)[0] for path in (tmp_path / "cache").glob("*.so")}
    assert built == libraries
