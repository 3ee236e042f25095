"""Kernels are bound once, at load: the backend (CADENZA_KERNELS) is read when a model is
prepared, never on an op's path.

Read from the source with ast: no function under kernels/ reads the environment but the named
load-time ones, and only the named binders ask for the backend (the model asks none). Then
behaviourally: once a model is prepared, switching CADENZA_KERNELS changes nothing that runs,
and nothing reads the variable again.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import cadenza.kernels
import cadenza.models
from cadenza import LLM, SamplingParams
from cadenza.kernels import backend as backend_module
from cadenza.kernels import ops
from cadenza.kernels.attention import dispatch
from cadenza.kernels.cpu.decode_stack import decode_layers_available
from cadenza.kernels.linear import cpu_fp32

KERNELS = Path(cadenza.kernels.__file__).parent
MODELS = Path(cadenza.models.__file__).parent
ENV_NAMES = frozenset({"environ", "environb", "getenv", "getenvb"})

# (file under kernels/, function) -> why it may read the environment.
ENV_READERS = {
    ("backend.py", "backend"): "the one reader of CADENZA_KERNELS, called only by the binders below",
    ("cpu/build.py", "cache_dir"): "where built C libraries are kept: read by load(), once per library (cached)",
    ("cpu/build.py", "compiler"): "the C compiler (CC): read by load(), once per library (cached)",
}
# (file under kernels/, function) -> why it may ask backend() which kernels run.
BINDERS = {
    ("ops.py", "bind_kernels"): "a model's ops bundle, bound by prepare_kernels",
    ("linear/choose.py", "choose_linear_method"): "each projection's method, chosen by prepare_kernels",
    ("linear/packed.py", "PackedLinear.__init__"): "binds the C kernels to the weight as it is built",
    ("linear/triton_packed.py", "TritonPackedLinear.__init__"): "binds its GEMM as it is built",
}


class _Scan(ast.NodeVisitor):
    """The qualified names of the functions ("<module>" for top-level code) that read the
    environment (os.environ / os.getenv, however os or its names were imported) or call
    backend()."""

    def __init__(self) -> None:
        self.scope: list[str] = []
        self.os_names, self.env_aliases = {"os"}, set()
        self.env_reads: set[str] = set()
        self.backend_calls: set[str] = set()

    def _where(self) -> str:
        return ".".join(self.scope) or "<module>"

    def _enter(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _enter

    def visit_Import(self, node: ast.Import) -> None:
        self.os_names |= {alias.asname or alias.name for alias in node.names if alias.name == "os"}

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module == "os":
            self.env_aliases |= {alias.asname or alias.name for alias in node.names if alias.name in ENV_NAMES}

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and node.value.id in self.os_names and node.attr in ENV_NAMES:
            self.env_reads.add(self._where())
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in self.env_aliases:
            self.env_reads.add(self._where())

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if (isinstance(func, ast.Name) and func.id == "backend") or (
            isinstance(func, ast.Attribute) and func.attr == "backend"
        ):
            self.backend_calls.add(self._where())
        self.generic_visit(node)


def scan(source: str) -> _Scan:
    found = _Scan()
    found.visit(ast.parse(source))
    return found


def _scan_tree(root: Path) -> Iterator[tuple[str, _Scan]]:
    for path in sorted(root.rglob("*.py")):
        yield path.relative_to(root).as_posix(), scan(path.read_text())


def test_the_scan_finds_every_spelling_of_a_read() -> None:
    source = """
import os
import os as system
from os import environ as env, getenv

top = os.environ.get("A")

class Method:
    def apply(self):
        return backend(self.device) == "cpu"

def plain():
    return os.getenv("B"), system.environ["C"], env["D"], getenv("E")

def binder():
    return kernels_backend.backend()

def clean(kernels):
    return kernels.backend, os.path.join("a", "b")
"""
    found = scan(source)
    assert found.env_reads == {"<module>", "plain"}
    assert found.backend_calls == {"Method.apply", "binder"}


def test_only_load_time_functions_under_kernels_read_the_environment() -> None:
    reads = {(name, fn) for name, found in _scan_tree(KERNELS) for fn in found.env_reads}
    assert reads == set(ENV_READERS), "read it where the kernels are bound, then add it to ENV_READERS"


def test_only_the_binders_ask_which_backend_runs() -> None:
    calls = {(name, fn) for name, found in _scan_tree(KERNELS) for fn in found.backend_calls}
    assert calls == set(BINDERS), "an op must not ask per call: bind its implementation at load"
    models = {(name, fn) for name, found in _scan_tree(MODELS) for fn in found.backend_calls}
    assert models == set(), "a model holds its Kernels bundle; it never asks for the backend"


def test_a_bundle_is_chosen_when_bound_and_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CADENZA_KERNELS", "torch")
    kernels = ops.bind_kernels(torch.device("cpu"))
    monkeypatch.setenv("CADENZA_KERNELS", "triton")
    assert kernels is ops.BUNDLES["torch"] and kernels.backend == "torch"
    assert ops.bind_kernels(torch.device("cpu")) is ops.BUNDLES["triton"]  # a new binding sees the change
    with pytest.raises(dataclasses.FrozenInstanceError):
        kernels.rms_norm = ops.BUNDLES["triton"].rms_norm  # type: ignore[misc]


C_PATHS = (  # (module, function): what the `cpu` backend runs that `torch` does not
    (ops, "fused_add_rms_norm_cpu"),
    (ops, "rotary_cpu"),
    (ops, "silu_and_mul_cpu"),
    (dispatch, "paged_decode_attention_cpu"),
    (cpu_fp32, "linear_few_rows"),
)


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    counts = {name: 0 for _, name in C_PATHS}
    for module, name in C_PATHS:
        monkeypatch.setattr(module, name, _counted(counts, name, getattr(module, name)))
    return counts


def _counted(counts: dict[str, int], name: str, fn: Callable[..., object]) -> Callable[..., object]:
    def wrapper(*args: object, **kwargs: object) -> object:
        counts[name] += 1
        return fn(*args, **kwargs)

    return wrapper


class _Environ(dict):
    """os.environ as backend.py sees it, recording each read of CADENZA_KERNELS."""

    def __init__(self, value: str, reads: list[str]) -> None:
        super().__init__(CADENZA_KERNELS=value)
        self.reads = reads

    def get(self, key: str, default: object = None) -> object:
        self.reads.append(key)
        return super().get(key, default)


def _generate(llm: LLM) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": [5, 9, 14, 3, 77]}, params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def _switch_after_load(monkeypatch: pytest.MonkeyPatch, to: str) -> tuple[dict[str, int], list[str]]:
    """CADENZA_KERNELS set to `to` from here on, the C paths counted, backend()'s reads recorded."""
    monkeypatch.setenv("CADENZA_KERNELS", to)
    reads: list[str] = []
    monkeypatch.setattr(backend_module, "os", type("os", (), {"environ": _Environ(to, reads)}))
    return _count_calls(monkeypatch), reads


def test_a_model_prepared_on_torch_keeps_torch(tiny_model, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CADENZA_KERNELS", "torch")
    path, _ = tiny_model("llama_gqa_tied")
    llm = LLM(str(path), block_size=8, num_blocks=32)
    before = _generate(llm)
    model = llm.engine.runner.model
    bound = model.kernels
    assert bound is ops.BUNDLES["torch"] and model.decode_stack is None
    counts, reads = _switch_after_load(monkeypatch, "cpu")
    assert _generate(llm) == before
    assert model.kernels is bound
    assert counts == {name: 0 for _, name in C_PATHS}, "a C kernel ran on a model bound to torch"
    assert reads == [], "CADENZA_KERNELS was read after the model was prepared"


@pytest.mark.skipif(not decode_layers_available(), reason="no C compiler: the CPU kernels cannot be built here")
def test_a_model_prepared_on_cpu_keeps_the_c_kernels(tiny_model, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CADENZA_KERNELS", "cpu")
    path, _ = tiny_model("llama_gqa_tied")
    llm = LLM(str(path), block_size=8, num_blocks=32, enable_prefix_caching=False)
    before = _generate(llm)
    model = llm.engine.runner.model
    assert model.kernels is ops.BUNDLES["cpu"] and model.decode_stack is not None
    model.decode_stack = None  # one-token steps op by op too, so every C path below is reached
    counts, reads = _switch_after_load(monkeypatch, "torch")
    got = _generate(llm)
    assert got == before
    assert all(counts.values()), f"a C path stopped running after CADENZA_KERNELS changed: {counts}"
    assert reads == [], "CADENZA_KERNELS was read after the model was prepared"
