#!/usr/bin/env bash
# The GPU checks in one command, for a machine with CUDA (torch, transformers, triton and pytest
# installed; nothing to carry): the fused backend's tests marked gpu, the Triton kernels' and the
# triton backend's tests compiled on the GPU (every default test of tests/test_triton.py, the gpu ones
# included: no host synchronisation over a train step, a CUDA graph of one; one kernel config each, no
# tuning), then both benchmarks with fused and triton beside SDPA (the train step with GPT-2's
# attention dropout 0.1 and without). Output to $OUT/gpu_check.txt (runs/gpu_check.txt elsewhere).
#   bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset TRITON_INTERPRET
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'triton', triton.__version__)"
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused.py tests/test_compile.py
    HF_SPANATTN_TRITON_TUNE=0 python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/test_triton.py
    python3 -m benchmarks.attention --device cuda --dtype bfloat16
    python3 -m benchmarks.train_step --device cuda
    python3 -m benchmarks.train_step --device cuda --attn-dropout 0
} 2>&1 | tee "$OUT/gpu_check.txt"
