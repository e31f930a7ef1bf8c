#!/usr/bin/env bash
# The GPU run of issue 37, one command on a machine with CUDA, torch, Lightning and pytest (the device image has
# them; its interpreter is python3):
#   bash benchmarks/gpu_check.sh     # the gpu tests, then python -m benchmarks.gpu; everything lands in $OUT
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
out="${OUT:-/tmp/rudra-gpu}"
mkdir -p "$out"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/nvidia-smi.txt"
"$py" -c "import torch, pytorch_lightning as pl; print('torch', torch.__version__, 'lightning', pl.__version__)"
"$py" -m pytest -m gpu tests/gpu -p no:cacheprovider -q -rA 2>&1 | tee "$out/gpu-tests.txt"
tests=${PIPESTATUS[0]}
timeout 420 "$py" -m benchmarks.gpu --out "$out" 2>"$out/gpu-bench.log"
bench=$?
tail -5 "$out/gpu-bench.log"
echo "gpu tests exit $tests, benchmark exit $bench"
exit $(( tests || bench ))
