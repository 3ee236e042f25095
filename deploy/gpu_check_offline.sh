#!/bin/sh
# Runs the GPU check (`cadenza gpu-check`) from this checkout on a GPU host with no network,
# with what gpu_bundle.sh packed; the host's python3 must hold PyTorch, Triton, numpy,
# transformers and setuptools. Arguments go to the check: `sh deploy/gpu_check_offline.sh
# --budget-s 400 > gpu_check.json`.
set -eu
bundle=${GPU_BUNDLE:-.gpu-bundle}
site=$(mktemp -d)
# The checkout is installed too, not put on the path: its top-level folders are the package's
# cadenza.kernels, cadenza.actors and cadenza.gateway only once installed.
python3 -m pip install -q --no-index --no-deps --no-compile --no-build-isolation --target "$site" \
    "$bundle"/wheels/*.whl .
if [ -f "$bundle/nixl.tar.xz" ]; then tar -C "$site" -xJf "$bundle/nixl.tar.xz"; fi
# Out of the checkout, or `python3 -m` would find its cadenza/ folder before the installed one.
cd "$site"
PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" exec python3 -m cadenza.benchmarks.gpu_check "$@"
