"""Imports flow one way: entry points (cli -> benchmarks) -> gateway -> actors -> models ->
kernels -> base (cadenza/). Read from the source with ast, every import counted, whether at
the top of a module, inside a function or under TYPE_CHECKING; and no two modules import each
other, directly or round a longer loop (imports under TYPE_CHECKING aside: they never run)."""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
# Lowest first: a module may import its own layer and any below it.
LAYERS = ("base", "kernels", "models", "actors", "gateway", "benchmarks", "cli")
# The package root is the public facade (`from cadenza import LLM`): it names upper layers
# lazily, by string, in its __getattr__, and is no layer's dependency.
FACADE = "cadenza"


def _package_dirs() -> dict[str, Path]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in config["package-dir"].items()}


def _modules() -> dict[str, Path]:
    """Every module of the cadenza package, by dotted name, from pyproject's package-dir."""
    found: dict[str, Path] = {}
    for package, folder in _package_dirs().items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    return "base"


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            guarded |= {id(child) for stmt in node.body for child in ast.walk(stmt)}
    return guarded


def imports_of(module: str, path: Path, known: set[str]) -> list[tuple[str, int, bool]]:
    """(imported cadenza module, line, runs at all) for every import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    guarded = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, int, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).rstrip(".")
            # `from cadenza.kernels import ops` imports the module cadenza.kernels.ops.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            target = _nearest_module(name, known)
            entry = (target, node.lineno, id(node) not in guarded)
            if target is not None and target != module and entry not in found:
                found.append(entry)
    return found


def _nearest_module(name: str, known: set[str]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _graph() -> dict[str, list[tuple[str, int, bool]]]:
    modules = _modules()
    known = set(modules)
    return {m: imports_of(m, p, known) for m, p in modules.items()}


def test_every_module_is_found() -> None:
    modules = _modules()
    for expected in ("cadenza.config", "cadenza.actors.engine_core", "cadenza.gateway.app", "cadenza.cli.main"):
        assert expected in modules
    assert {layer_of(m) for m in modules} == set(LAYERS)


def test_imports_flow_one_way() -> None:
    modules = _modules()
    wrong = []
    for module, imports in _graph().items():
        if module == FACADE:
            continue
        rank = LAYERS.index(layer_of(module))
        for target, line, _ in imports:
            if target != FACADE and LAYERS.index(layer_of(target)) > rank:
                wrong.append(f"{modules[module].relative_to(ROOT)}:{line} ({layer_of(module)}) imports {target}")
            elif target == FACADE and module != FACADE:
                wrong.append(f"{modules[module].relative_to(ROOT)}:{line} imports the facade `cadenza`")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_no_import_cycles() -> None:
    graph = {m: sorted({t for t, _, runs in imports if runs}) for m, imports in _graph().items() if m != FACADE}
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """One cycle per strongly connected component bigger than a module (Tarjan, iteratively
    deep enough for this graph)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, []):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return components


def test_the_checker_sees_a_wrong_import(tmp_path: Path) -> None:
    """The checker itself: an upward import and a cycle in a scratch file are both reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("from cadenza.gateway.app import build_app\nimport cadenza.actors.llm\n")
    known = {"cadenza.kernels.bad", "cadenza.gateway.app", "cadenza.actors.llm"}
    found = imports_of("cadenza.kernels.bad", bad, known)
    assert [(t, line) for t, line, _ in found] == [("cadenza.gateway.app", 1), ("cadenza.actors.llm", 2)]
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]


# Small files: the longest module was 534 lines (model_runner.py) before the runner was split.
MAX_LINES = 400
# The only places under kernels/ that read the environment, and when: the backend, read once
# when a model binds its kernels (kernels/ops.bind_kernels), and the C build's cache folder
# and compiler, read when a library is first built.
KERNEL_ENV_READERS = {"backend.py", "build.py"}


def test_no_module_is_over_400_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n for p in _modules().values() if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def environment_reads(source: str) -> list[int]:
    """Lines that read the environment: os.environ / os.getenv in any form."""
    return sorted(
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb")
    )


def test_kernels_read_the_environment_only_at_load_time() -> None:
    kernels = _package_dirs()["cadenza.kernels"]
    reads = {
        str(p.relative_to(ROOT)): lines
        for p in kernels.rglob("*.py")
        if p.name not in KERNEL_ENV_READERS and (lines := environment_reads(p.read_text()))
    }
    assert not reads, f"environment read on the per-op path: {reads}"


def private_reach(source: str) -> list[str]:
    """`other._name` for any object but self, cls or super(): reaching into another object's
    private state, across a seam or not."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
            continue
        found.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(found)


def test_no_module_reaches_into_another_objects_private_state() -> None:
    """The engine's seams (actor -> core -> scheduler, executor -> worker -> runner) and every
    other: a module uses another object's public verbs only."""
    reached = {str(p.relative_to(ROOT)): hits for p in _modules().values() if (hits := private_reach(p.read_text()))}
    assert not reached, f"private attributes of another object: {reached}"


def test_the_seam_checkers_see_what_they_should() -> None:
    assert environment_reads("import os\nos.environ.get('X')\nx = os.getenv('Y')\n") == [2, 3]
    assert private_reach("self._a\ncls._b\nsuper()._c\ncore._in_flight\nself.core._steps\n") == [
        "4: core._in_flight",
        "5: self.core._steps",
    ]
