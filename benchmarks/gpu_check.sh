#!/usr/bin/env bash
# The GPU run of issue 37, one command on a machine with CUDA, torch and Lightning installed and nothing else:
#   bash benchmarks/gpu_check.sh            # the GPU tests, then python -m benchmarks.gpu; results in $OUT (or /tmp)
# Wheels for the test tools travel in .gpu_wheels/ (made here with:
#   pip download --no-deps -d .gpu_wheels pytest pytest-timeout pluggy iniconfig packaging).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/rudra-gpu}"
mkdir -p "$out"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
if ! python -c "import pytest, pytest_timeout" 2>/dev/null; then
    python -m pip install -q --no-index --find-links .gpu_wheels pytest pytest-timeout
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/nvidia-smi.txt"
python -c "import torch, pytorch_lightning as pl; print('torch', torch.__version__, 'lightning', pl.__version__)"
python -m pytest -m gpu tests/gpu -p no:cacheprovider -q -rA 2>&1 | tee "$out/gpu-tests.txt"
tests=$?
timeout 420 python -m benchmarks.gpu --out "$out" 2>"$out/gpu-bench.log"
bench=$?
tail -5 "$out/gpu-bench.log"
echo "gpu tests exit $tests, benchmark exit $bench"
exit $(( tests || bench ))
