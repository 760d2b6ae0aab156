#!/usr/bin/env bash
# One GPU command of the paper's sweep: as many whole runs of recipes/configs/paper_gpu.yaml as
# fit in the budget, skipping those already merged into results/paper/runs. Made for a GPU machine
# without internet access and a 10-minute limit per command: fetch the wheels and the data on a
# connected machine first, and copy `.whl/` and `.data/` beside the checkout there:
#   bash scripts/fetch_gpu_wheels.sh && bash scripts/fetch_gpu_data.sh        # connected machine, once
#   bash scripts/gpu_sweep.sh [--parallel N] [--accum K] [--budget S] [--max_runs N] [--keep_other_settings]
# then, back here:  python recipes/merge.py <$OUT>/results.jsonl --out results/paper
#   --parallel N  runs at once on the GPU (default 1)
#   --accum K     batch 128 as K accumulated steps of 128/K (default 1: one step, if memory allows)
#   --budget S    seconds in which runs may start and finish (default 540, inside the 600 s command)
#   --keep_other_settings  count runs finished in $OUT or the tree with other settings (an edited sweep file)
#                 as finished; without it such a run stops the command, named (another --accum is no other setting)
# Writes to $OUT (default runs/gpu_out): results.jsonl (one line per finished run), pack.log and
# env.txt (GPU and package versions).
[ -n "${BASH_VERSION:-}" ] || { echo "gpu_sweep.sh: a bash script: run it as bash scripts/gpu_sweep.sh" >&2; exit 2; }
set -euo pipefail
[[ -z "${OUT:-}" || "$OUT" = /* ]] || OUT="$PWD/$OUT"  # a relative OUT is read from where the script was called
cd "$(dirname "$0")/.."
PARALLEL=1 ACCUM=1 BUDGET=540 CONFIG=recipes/configs/paper_gpu.yaml MAX_RUNS= KEEP=
while [ $# -gt 0 ]; do
    case "$1" in --parallel|--accum|--budget|--config|--max_runs)
        [ $# -ge 2 ] || { echo "gpu_sweep.sh: $1 needs a value" >&2; exit 2; } ;;
    esac
    case "$1" in
        --parallel) PARALLEL="$2"; shift 2 ;;
        --accum) ACCUM="$2"; shift 2 ;;
        --budget) BUDGET="$2"; shift 2 ;;
        --config) CONFIG="$2"; shift 2 ;;
        --max_runs) MAX_RUNS="${2:-empty}"; shift 2 ;;
        --keep_other_settings) KEEP=--keep_other_settings; shift ;;
        *) echo "gpu_sweep.sh: unknown option $1 (allowed: --parallel, --accum, --budget, --config, --max_runs," \
                "--keep_other_settings)" >&2
           exit 2 ;;
    esac
done
for flag in parallel:"$PARALLEL" accum:"$ACCUM"; do
    [[ "${flag#*:}" =~ ^[1-9][0-9]*$ ]] || { echo "gpu_sweep.sh: --${flag%%:*} ${flag#*:}: expected an integer >= 1" >&2
                                             exit 2; }
done
[[ "$BUDGET" =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?$ ]] || {
    echo "gpu_sweep.sh: --budget $BUDGET: expected a number of seconds >= 0" >&2; exit 2; }
[[ "$MAX_RUNS" =~ ^[0-9]*$ ]] || { echo "gpu_sweep.sh: --max_runs $MAX_RUNS: expected an integer >= 0" >&2; exit 2; }
EXTRA=(${MAX_RUNS:+--max_runs "$MAX_RUNS"} $KEEP)
[ -f "$CONFIG" ] || { echo "gpu_sweep.sh: --config $CONFIG: no such file" >&2; exit 2; }
# more than 3 digits cannot divide 128, and bash's arithmetic would wrap a number past 2^63
if [ ${#ACCUM} -gt 3 ] || [ $((128 % ACCUM)) -ne 0 ]; then echo "gpu_sweep.sh: --accum $ACCUM must divide 128" >&2; exit 2; fi
cuda=$(python3 -c "import torch; print(torch.cuda.is_available())" 2>/dev/null) || cuda="python3 cannot import torch"
[ "$cuda" = True ] || { echo "gpu_sweep.sh: no GPU here (${cuda/False/torch sees no CUDA device}): the script is" \
                            "for a machine with CUDA; recipes/sweep.py runs a sweep on the CPU" >&2; exit 2; }
OUT="${OUT:-runs/gpu_out}"
mkdir -p "$OUT"
ls .whl/*.whl >/dev/null 2>&1 || { echo "no .whl/*.whl: run scripts/fetch_gpu_wheels.sh and carry .whl" >&2; exit 2; }
[ -f .data/wikitext-2-v1/train.txt ] || { echo "no .data/: run scripts/fetch_gpu_data.sh and carry .data" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD/src" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# triton: it passes its GPU tests and matches fused within bf16 rounding; with dropout 0.1 its step is the faster
export HF_SPANATTN_BACKEND="${HF_SPANATTN_BACKEND:-triton}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  python3 -c "import os, datasets, evaluate, torch, transformers, pyarrow, hf_spanattn as h
print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__,
      'datasets', datasets.__version__, 'evaluate', evaluate.__version__, 'pyarrow', pyarrow.__version__,
      'hf_spanattn', h.__version__, 'backend', os.environ['HF_SPANATTN_BACKEND'])
assert torch.cuda.is_available(), 'no GPU visible to torch'"
} 2>&1 | tee "$OUT/env.txt"
python3 recipes/pack.py "$CONFIG" --budget "$BUDGET" --parallel "$PARALLEL" --jsonl "$OUT/results.jsonl" \
    --set per_device_train_batch_size=$((128 / ACCUM)) --set gradient_accumulation_steps="$ACCUM" \
    "${EXTRA[@]}" 2>&1 | tee "$OUT/pack.log"
