#!/usr/bin/env bash
# Device checks for a lent GPU machine (one call, under 8 minutes). Prints every table; writes
# copies under $OUT when that is set. Sections:
#   1. static-shape buckets: 64 lengths, recordings and latency vs dynamic inductor
#   2. offload: pinned host->device bandwidth, then per-forward latency of graphpass offload
#      (storage="pinned") against max(compute, offloaded bytes / bandwidth), accelerate
#      cpu_offload and, where it installs, FlexTensor (bench/gpu_offload.py)
#   3. offload correctness on the device: tests/test_offload_cuda.py (pinned/cpu/disk tiers, side
#      stream, staging buffers, training), where pytest is installed
set -euo pipefail
cd "$(dirname "$0")/.."
# the lent machine is offline: install without an isolated build env (setuptools is in its image)
python3 -m pip install -q --no-build-isolation --no-deps -e . || python3 -m pip install -q --no-build-isolation --no-deps .
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
echo "== static-shape buckets =="
PYTHONUNBUFFERED=1 timeout 180 python3 bench/gpu_static_shapes.py --lengths 64 | tee "$out/static_shapes_gpu.txt" \
  || echo "static-shape section failed (rc $?); going on" | tee -a "$out/static_shapes_gpu.txt"
echo "== offload =="
# FlexTensor, where it installs. The lent machine has no network: wheels carried in .whl/ (flextensor and
# the dependencies missing there) are installed from there; otherwise a short pip try, then "not available".
if ls .whl/flextensor-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ft-site .whl/*.whl \
    && export PYTHONPATH="/tmp/ft-site${PYTHONPATH:+:$PYTHONPATH}" || echo "flextensor: install from .whl failed"
else
  timeout 60 python3 -m pip install -q --retries 0 --timeout 5 flextensor >/dev/null 2>&1 || echo "flextensor: not installed"
fi
# at most 240 s, less if the sections above ran long: the whole script stays under 8 minutes
left=$(( 460 - SECONDS ))
if [ "$left" -gt 240 ]; then left=240; fi
if [ "$left" -lt 60 ]; then
  echo "offload: skipped, only ${left} s left of the 8 minutes" | tee "$out/offload_gpu.txt"
else
  PYTHONUNBUFFERED=1 timeout "$left" python3 bench/gpu_offload.py | tee "$out/offload_gpu.txt"
fi
echo "== offload on CUDA: tests =="
if python3 -c "import pytest" 2>/dev/null; then
  left=$(( 470 - SECONDS ))
  if [ "$left" -gt 30 ]; then
    timeout "$left" python3 -m pytest -q -p no:cacheprovider tests/test_offload_cuda.py 2>&1 | tail -15 | tee "$out/offload_cuda_tests.txt" || true
  else
    echo "skipped: only ${left} s left" | tee "$out/offload_cuda_tests.txt"
  fi
else
  echo "pytest not installed on this machine: tests/test_offload_cuda.py not run" | tee "$out/offload_cuda_tests.txt"
fi
