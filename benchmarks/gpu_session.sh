#!/usr/bin/env bash
# The device checks of a lent GPU machine (the `device` tool), as one prepared command.
#
#   here, once:  bash benchmarks/gpu_session.sh --wheels
#                (downloads into .whl/, which .git/info/exclude ignores, the Python 3.12 wheels
#                the GPU image lacks: msgspec, pyzmq, typeguard; it has torch 2.11, numpy,
#                pyyaml, pytest, hypothesis)
#   on the GPU:  run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=540)
#
# On the GPU it installs the carried wheels, then runs, each under its own time limit so that
# one that hangs leaves time for the rest: the GPU tests of the served path (a worker on the
# GPU, its capturable nodes replayed from CUDA graphs: tests/gpu/test_served_cuda.py) and of
# CUDA-graph replay per component (test_cuda_graphs.py), then bench_loops on CUDA (--quick).
# Logs and results land in $OUT: tests.log, loops.log, gpu_cuda_graphs.json (per-component
# replay timings, for benchmarks/results/) and loops_cuda.json (bench_loops on the GPU).
set -u
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--wheels" ]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl msgspec pyzmq typeguard
fi
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || { echo "wheels did not install"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" \
  | tee -a "$OUT/gpu.txt"
WALKSERVE_GPU_RESULTS="$OUT/gpu_cuda_graphs.json" timeout 240 python3 -m pytest -q \
  -p no:cacheprovider tests/gpu/test_served_cuda.py tests/gpu/test_cuda_graphs.py 2>&1 \
  | tee "$OUT/tests.log"
timeout 240 python3 benchmarks/bench_loops.py --quick --device cuda 2>&1 | tee "$OUT/loops.log"
cp benchmarks/results/loops_cuda.json "$OUT/" 2>/dev/null || echo "no loops_cuda.json"
