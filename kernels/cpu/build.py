"""Building kernels/csrc for this host: the compiler, its flags, the cache key, the build itself.

Each csrc/<name>.c becomes a shared library (and each of VARIANTS another, built from a
source with extra defines) compiled by the host's C compiler (`CC`, default
`cc`) for this very CPU (-march=native), cached under CADENZA_CACHE_DIR (default
~/.cache/cadenza) as <name>-<key>.so, so a machine builds each library once (about a second).
Plain C and ctypes rather than a torch C++ extension: no torch headers, no ninja, nothing to
rebuild when torch changes. Without a compiler, or if the build fails, `load` returns None
(and logs why) and the ops fall back to the torch reference.

The key hashes everything the built code depends on: every csrc source and header, the
compiler command and flags, the compiler's `--version` (another compiler emits other code)
and the CPU's model and feature flags (-march=native code may use instructions another CPU
lacks: a cache directory on a shared home, or a VM moved to another host).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCES = Path(__file__).parent.parent / "csrc"
# -fassociative-math (with the two flags it needs) lets the compiler vectorise the dot
# products' reductions; full -ffast-math would also assume no infinities.
# -Wmissing-prototypes: every exported function must be declared in cadenza_kernels.h.
CFLAGS = (
    "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared",
    "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
    "-Wall", "-Wmissing-prototypes", "-Werror",
)  # fmt: skip
# Libraries built from another library's source with extra flags: name -> (source, flags).
# The fp16-KV kernels are the fp32 ones with kv_t = fp16 (cadenza_kernels.h).
VARIANTS = {
    "decode_attention_f16": ("decode_attention", ("-DCADENZA_KV_F16",)),
    "decode_layer_f16": ("decode_layer", ("-DCADENZA_KV_F16",)),
}
CPUINFO = Path("/proc/cpuinfo")
# What -march=native depends on, as /proc/cpuinfo names it ("Features": ARM's "flags").
_CPU_FIELDS = ("model name", "flags", "Features")
log = logging.getLogger(__name__)


def cache_dir() -> Path:
    return Path(os.environ.get("CADENZA_CACHE_DIR", Path.home() / ".cache" / "cadenza"))


def compiler() -> str:
    return os.environ.get("CC", "cc")


@functools.cache
def compiler_version(command: str) -> str:
    """`command --version`'s output ("" when it gives none)."""
    try:
        done = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout + done.stderr


def cpu_identity(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's model name and feature flags (Linux, first core), else platform.processor()."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        text = ""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, colon, value = line.partition(":")
        if colon and key.strip() in _CPU_FIELDS:
            fields.setdefault(key.strip(), value.strip())
    if not fields:
        return platform.processor() or platform.machine()
    return "\n".join(f"{key}: {value}" for key, value in sorted(fields.items()))


def cache_key(command: str) -> str:
    """16 hex digits of a SHA-256 over the sources, the build command, compiler and CPU."""
    # Sources include each other (decode_layer.c includes the rest) and the header: hash them all.
    parts = [path.read_bytes() for path in sorted(SOURCES.glob("*.[ch]"))]
    parts += [s.encode() for s in (" ".join((command, *CFLAGS)), compiler_version(command), cpu_identity())]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The shared library built from csrc/<name>.c, or None when it cannot be built here."""
    command = compiler()
    if shutil.which(command) is None:
        log.warning("no C compiler (%s) on PATH: the CPU runs the torch reference for %s", command, name)
        return None
    source, defines = VARIANTS.get(name, (name, ()))
    target = cache_dir() / f"{name}-{cache_key(command)}.so"
    if not target.exists() and not _build(command, SOURCES / f"{source}.c", target, defines):
        return None
    return ctypes.CDLL(str(target))


def _build(command: str, source: Path, target: Path, defines: tuple[str, ...] = ()) -> bool:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes that race to build never load half a file.
    fd, scratch = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [command, *CFLAGS, *defines, str(source), "-o", scratch, "-lm"], capture_output=True, text=True
        )
        if done.returncode != 0:
            log.warning("building %s failed; the torch reference runs instead:\n%s", source.name, done.stderr[-2000:])
            return False
        os.replace(scratch, target)
        return True
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
