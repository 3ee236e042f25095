#!/bin/sh
# Packs what `cadenza gpu-check` needs beyond PyTorch, Triton, numpy and transformers, for a
# GPU host that cannot reach PyPI: the msgspec and gguf wheels, and NIXL's transfer library for
# the `kv_nixl` case. Run it where pip works, in the checkout; copy the checkout with the
# folder to that host; run deploy/gpu_check_offline.sh there (docs/gpus.md).
#   GPU_PYTHON  the GPU host's Python (default 3.12)
#   GPU_CUDA    its CUDA major version, which picks nixl-cu12 or nixl-cu13 (default 13)
#   GPU_BUNDLE  the folder to write (default .gpu-bundle, which git ignores)
set -eu
py=${GPU_PYTHON:-3.12}
cuda=${GPU_CUDA:-13}
out=${GPU_BUNDLE:-.gpu-bundle}
rm -rf "$out"
mkdir -p "$out/wheels" "$out/nixl_wheel" "$out/nixl"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$out/wheels" "msgspec>=0.18" "gguf>=0.10"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
    --implementation cp --platform manylinux_2_28_x86_64 -d "$out/nixl_wheel" "nixl-cu$cuda>=1.5.1"
# NIXL's wheel (about 60 MB) also holds its expert-parallel kernels (nixl_ep_*) and C++
# headers, which the check never loads; unpacking only the transfer library and its bundled
# libraries halves it, so the bundle and a checkout fit where a copy is size-limited.
python3 - "$out/nixl_wheel" "$out/nixl" <<'PY'
import pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("*.whl"))
with zipfile.ZipFile(wheel) as archive:
    kept = [n for n in archive.namelist() if not n.startswith("nixl_ep") and ".data/" not in n]
    archive.extractall(sys.argv[2], kept)
PY
tar -C "$out/nixl" -cJf "$out/nixl.tar.xz" .
rm -rf "$out/nixl_wheel" "$out/nixl"
du -sh "$out"
