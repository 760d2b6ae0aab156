#!/usr/bin/env bash
# The GPU checks of the fused backend in one command, for a machine with CUDA (torch, transformers
# and pytest installed; nothing to carry): the tests marked gpu, the fused path's accuracy and
# no-sync tests, then both benchmarks. Output to $OUT/gpu_check.txt (runs/gpu_check.txt elsewhere).
#   bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused.py tests/test_compile.py
    python3 -m benchmarks.attention --device cuda --dtype bfloat16
    python3 -m benchmarks.train_step --device cuda
} 2>&1 | tee "$OUT/gpu_check.txt"
