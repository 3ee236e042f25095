"""`make test` runs two pytest-xdist workers; each must take a test module whole and in its
order, so a module's fixtures are built once and its tests that build on each other (a killed
engine, say) keep their order. This runs two small modules with the Makefile's own xdist flags.
(`--dist loadgroup` with `xdist_group` marks did not do it under pytest 9: every test went to
any worker on its own, and CI once ran a module's fault tests on two workers.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULE = """
import pytest

BUILT = []


@pytest.fixture(scope="module")
def shared():
    BUILT.append(1)
    return BUILT


@pytest.mark.parametrize("i", range(6))
def test_step(shared, i):
    assert len(shared) == 1  # built once in this worker
"""


def _makefile_dist() -> list[str]:
    """The xdist flags `make test` passes, with PYTEST_WORKERS at its default."""
    text = (ROOT / "Makefile").read_text()
    workers = re.search(r"^PYTEST_WORKERS \?= (\d+)$", text, re.M)
    parallel = re.search(r"^PYTEST_PARALLEL := .*,-n \$\(PYTEST_WORKERS\) (.*)\)$", text, re.M)
    assert workers and parallel, "the Makefile's PYTEST_WORKERS / PYTEST_PARALLEL lines moved"
    return ["-n", workers[1], *parallel[1].split()]


def test_each_module_runs_whole_and_in_order_on_one_worker(tmp_path: Path) -> None:
    for name in ("test_first.py", "test_second.py"):
        (tmp_path / name).write_text(MODULE)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *_makefile_dist(), str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    ran = re.findall(r"\[(gw\d)\] .*?PASSED (test_\w+)\.py::test_step\[(\d)\]", run.stdout)
    assert len(ran) == 12, run.stdout
    for module in ("test_first", "test_second"):
        mine = [(worker, int(i)) for worker, name, i in ran if name == module]
        assert len({worker for worker, _ in mine}) == 1, mine  # one worker
        assert [i for _, i in mine] == list(range(6)), mine  # in the module's order
