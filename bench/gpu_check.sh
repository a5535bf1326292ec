#!/usr/bin/env bash
# Device checks for a lent GPU machine (one call, under 8 minutes). Prints every table; writes
# copies under $OUT when that is set. Sections:
#   1. static-shape buckets: 64 lengths, recordings and latency vs dynamic inductor
# (the offload section of the offload issue is added with that work)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e . 2>/dev/null || python3 -m pip install -q --no-deps -e .
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
echo "== static-shape buckets =="
timeout 300 python3 bench/gpu_static_shapes.py --lengths 64 | tee "$out/static_shapes_gpu.txt"
