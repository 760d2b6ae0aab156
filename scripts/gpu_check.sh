#!/usr/bin/env bash
# The GPU checks in one command, for a machine with CUDA (torch, transformers, triton and pytest
# installed; nothing to carry). Figures first, then the tests, each step under its own time limit so
# that a slow one cannot take the others' time (at most 15 min 30 s in all; a step that runs out
# says so and the next one starts):
#   1. benchmarks.attention: forward+backward of fused and triton beside SDPA and eager, bf16 (150 s)
#   2. benchmarks.train_step: a GPT-2 train step, attention dropout 0.1, then 0 (150 s each)
#   3. benchmarks.profile_attention: the top CUDA kernels per call, and the share of the package's
#      Triton kernels (120 s)
#   4. the tests marked gpu of tests/test_fused.py, test_compile.py and test_triton.py: float64
#      references on CUDA, no host synchronisation over a train step, CUDA graphs, inductor (120 s)
#   5. the rest of tests/test_triton.py (not slow), its kernels compiled on the GPU (240 s)
# The Triton kernels run one config each throughout (HF_SPANATTN_TRITON_TUNE=0: no autotuning).
# All of it may pass a 10-minute command limit: `figures` runs steps 1-3 (at most 9 min 30 s) and
# `tests` steps 4-5 (at most 6 min), in two calls. Output to $OUT/gpu_check.txt, or to
# gpu_check_figures.txt and gpu_check_tests.txt ($OUT: runs unless set).
#   bash scripts/gpu_check.sh [all|figures|tests]
[ -n "${BASH_VERSION:-}" ] || { echo "gpu_check.sh: a bash script: run it as bash scripts/gpu_check.sh" >&2; exit 2; }
set -uo pipefail
[[ -z "${OUT:-}" || "$OUT" = /* ]] || OUT="$PWD/$OUT"  # a relative OUT is read from where the script was called
cd "$(dirname "$0")/.."
[ $# -le 1 ] || { echo "gpu_check.sh: one part at a time, got $# ($*; allowed: all, figures, tests)" >&2; exit 2; }
PART="${1:-all}"
case "$PART" in
    all|figures|tests) ;;
    *) echo "gpu_check.sh: unknown part '$PART' (allowed: all, figures, tests)" >&2; exit 2 ;;
esac
cuda=$(python3 -c "import torch; print(torch.cuda.is_available())" 2>/dev/null) || cuda="python3 cannot import torch"
[ "$cuda" = True ] || { echo "gpu_check.sh: no GPU here (${cuda/False/torch sees no CUDA device}): the script is" \
                            "for a machine with CUDA; scripts/test.sh runs the tests on the CPU" >&2; exit 2; }
OUT="${OUT:-runs}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_SPANATTN_TRITON_TUNE=0
unset TRITON_INTERPRET

step() {  # step SECONDS COMMAND...: the command under a time limit, with its title and how it ended
    local limit=$1
    shift
    echo "## $*"
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    [ "$rc" -eq 0 ] || failed=1
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "## stopped after ${limit} s"
    elif [ "$rc" -ne 0 ]; then
        echo "## exit status $rc"
    fi
}

failed=0
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'triton', triton.__version__)"
    if [ "$PART" != tests ]; then
        step 150 python3 -m benchmarks.attention --device cuda --dtype bfloat16
        step 150 python3 -m benchmarks.train_step --device cuda
        step 150 python3 -m benchmarks.train_step --device cuda --attn-dropout 0
        step 120 python3 -m benchmarks.profile_attention --device cuda
    fi
    if [ "$PART" != figures ]; then
        step 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused.py tests/test_compile.py \
            tests/test_triton.py
        step 240 python3 -m pytest -q -p no:cacheprovider -m "not slow and not gpu" tests/test_triton.py
    fi
    [ "$failed" -eq 0 ]  # the script's exit status: non-zero where a step failed or ran out of time
} 2>&1 | tee "$OUT/gpu_check$([ "$PART" = all ] || echo "_$PART").txt"
