#!/usr/bin/env bash
# The device checks of a lent GPU machine (the `device` tool), as one prepared command.
#
#   here, once:  bash benchmarks/gpu_session.sh --wheels
#                (downloads into .whl/, which .git/info/exclude ignores, the Python 3.12 wheels
#                the GPU image lacks or holds too old: msgspec, pyzmq, typeguard for the served
#                path; transformers 5.25 and its hub client, snac for the Orpheus bench; ~25 MB)
#   on the GPU:  run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=590)
#
# On the GPU it installs the carried wheels, then runs, each under its own time limit so that
# one that hangs leaves time for the rest (~9 minutes in all):
#   tests     the served path on the GPU (a worker there, its capturable nodes replayed from
#             CUDA graphs: tests/gpu/test_served_cuda.py), CUDA-graph replay per component
#             (test_cuda_graphs.py)
#   loops     bench_loops --quick --device cuda
#   speech    bench_speech --quick --device cuda at concurrency 1 and 8 (Orpheus)
# Name steps to run only those (`gpu_session.sh loops speech`). Logs and results land in
# $OUT: gpu.txt, tests.log, gpu_cuda_graphs.json (per-component replay timings), loops.log,
# loops_cuda.json, speech.log, speech_orpheus_cuda.json.
set -u
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--wheels" ]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl msgspec pyzmq typeguard \
    transformers==5.25.0 huggingface_hub==2.4.0 httpx2==2.17.0 httpcore2==2.17.0 \
    kernels==0.19.1 tomlkit truststore snac 'click>=8.4.2' 'regex>=2025.10.22' \
    'hf-xet>=1.6,<2' 'h11>=0.16' sniffio 'anyio>=4.10' 'idna>=3.18' \
    'typing-extensions>=4.16'
fi
steps=${*:-tests loops speech}
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || { echo "wheels did not install"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" \
  | tee -a "$OUT/gpu.txt"
for step in $steps; do
  case $step in
    tests)
      WALKSERVE_GPU_RESULTS="$OUT/gpu_cuda_graphs.json" timeout 200 python3 -m pytest -q \
        -p no:cacheprovider tests/gpu/test_served_cuda.py tests/gpu/test_cuda_graphs.py 2>&1 \
        | tee "$OUT/tests.log" ;;
    loops)
      timeout 150 python3 benchmarks/bench_loops.py --quick --device cuda 2>&1 \
        | tee "$OUT/loops.log"
      cp benchmarks/results/loops_cuda.json "$OUT/" 2>/dev/null ;;
    speech)
      timeout 180 python3 benchmarks/bench_speech.py --quick --device cuda --levels 1 8 2>&1 \
        | tee "$OUT/speech.log"
      cp benchmarks/results/speech_orpheus_cuda.json "$OUT/" 2>/dev/null ;;
    *) echo "unknown step $step (tests, loops, speech)" ;;
  esac
done
