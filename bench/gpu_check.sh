#!/usr/bin/env bash
# Device checks for a lent GPU machine: one call, under 8 minutes. Prints every table and writes a
# copy of each under $OUT when that is set. Sections, most important first (each has its own time
# cap, and a section that fails or runs out of time does not stop the others):
#   1. tests/offloading/test_offload_cuda.py: offload tiers on the device, training, and offload under CUDA graphs
#      (replays equal eager, host updates seen, fixed slots), where pytest is installed
#   2. decode under CUDA graphs with a quarter of the layers streamed (bench/gpu_decode.py)
#   3. a training step with offload against its bandwidth bound (bench/train_offload.py --device cuda)
#   4. peers on one diffusers transformer: diffusers group offloading, FlexTensor (bench/gpu_peers.py)
#   5. offload from pinned memory at 256 tokens against the bound and accelerate (bench/gpu_offload.py)
#   6. static-shape buckets against dynamic inductor (bench/gpu_static_shapes.py)
#   7. capture on against capture off under CUDA graphs, decode steps (bench/capture_cost.py --device cuda
#      --mode reduce-overhead); it prints how many graphs inductor kept off CUDA graphs
# The lent machine is offline: wheels it lacks (diffusers, flextensor and their needs) travel in .whl/
# (see docs/benchmarks.md for the download command) and are installed from there.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-build-isolation --no-deps -e . || python3 -m pip install -q --no-build-isolation --no-deps .
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gp-site .whl/*.whl \
    && export PYTHONPATH="/tmp/gp-site${PYTHONPATH:+:$PYTHONPATH}" || echo "wheels in .whl: install failed"
fi
out=${OUT:-/tmp}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$out/gpu.txt"

# section NAME CAP_SECONDS FILE COMMAND...: runs COMMAND for at most CAP seconds (less when the 8 minutes
# run short), output to the terminal and to $out/FILE
section() {
  local name=$1 cap=$2 file=$3; shift 3
  local left=$(( 465 - SECONDS ))
  if [ "$left" -lt "$cap" ]; then cap=$left; fi
  echo "== $name (at ${SECONDS} s, cap ${cap} s) =="
  if [ "$cap" -lt 20 ]; then
    echo "$name: skipped, only ${left} s left of the 8 minutes" | tee "$out/$file"
    return
  fi
  timeout "$cap" "$@" 2>&1 | tee "$out/$file"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || echo "$name: exit status $rc (124: out of time)" | tee -a "$out/$file"
}

# GPU_SECTIONS picks a subset for a rerun (default: all, in this order)
sections=" ${GPU_SECTIONS:-tests decode train peers capture offload static} "
want() { [[ "$sections" == *" $1 "* ]]; }
if want tests; then
  if python3 -c "import pytest" 2>/dev/null; then
    section "offload on CUDA: tests" 110 offload_cuda_tests.txt \
      python3 -m pytest -q -p no:cacheprovider --no-header -rfE tests/offloading/test_offload_cuda.py
  else
    echo "pytest not installed on this machine: tests/offloading/test_offload_cuda.py not run" | tee "$out/offload_cuda_tests.txt"
  fi
fi
want decode && section "decode under CUDA graphs" 130 decode_gpu.txt python3 bench/gpu_decode.py
want train && section "training with offload" 80 train_gpu.txt \
  python3 bench/train_offload.py --device cuda --then inductor --layers 6 --hidden 4096 --inter 16384 --tokens 4096 --steps 5 --warmup 2
want peers && section "peers on a diffusers transformer" 160 peers_gpu.txt python3 bench/gpu_peers.py --time-budget 115
want capture && section "capture on under CUDA graphs" 90 capture_gpu.txt \
  python3 bench/capture_cost.py --device cuda --mode reduce-overhead --layers 16 --hidden 2048 --prefill 0 --rounds 8 --block 8
want offload && section "offload from pinned memory" 45 offload_gpu.txt python3 bench/gpu_offload.py --layers 8 --tokens 256 --variants graphpass accelerate
want static && section "static-shape buckets" 40 static_shapes_gpu.txt python3 bench/gpu_static_shapes.py --lengths 16
echo "== done at ${SECONDS} s =="
