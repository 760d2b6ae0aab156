#!/usr/bin/env bash
# The main job: set up, train the standard gradient and score:1000 (2 seeds each) on WikiText-2, and report.
#   bash scripts/compare.sh                                  # data and tokenizer from the Hub
#   SPANATTN_DATA=../shared/data bash scripts/compare.sh     # offline: local WikiText-2 + tokenizer
# Writes runs/quick/report.md, report.csv and the PNG figures. Extra arguments go to sweep.py.
[ -n "${BASH_VERSION:-}" ] || { echo "compare.sh: a bash script: run it as bash scripts/compare.sh" >&2; exit 2; }
set -euo pipefail
if [ -n "${SPANATTN_DATA:-}" ] && [[ "$SPANATTN_DATA" != /* ]]; then
    SPANATTN_DATA="$PWD/$SPANATTN_DATA"  # relative to where the script was called, not to the checkout
fi
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's package, not one a PYTHONPATH holds
args=()
if [ -n "${SPANATTN_DATA:-}" ]; then
    for part in wikitext-2-v1/train.txt wikitext-2-v1/validation.txt gpt2-tokenizer; do
        [ -e "$SPANATTN_DATA/$part" ] || { echo "compare.sh: SPANATTN_DATA=$SPANATTN_DATA holds no $part: give the" \
            "folder that holds wikitext-2-v1/ and gpt2-tokenizer/ (../shared/data, see its README.md)" >&2; exit 2; }
    done
    export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
    args+=(--train_file "$SPANATTN_DATA/wikitext-2-v1/train.txt"
           --validation_file "$SPANATTN_DATA/wikitext-2-v1/validation.txt"
           --tokenizer_name "$SPANATTN_DATA/gpt2-tokenizer")
fi
# glibc would map each step's 100 MB logits afresh and fault their pages in: keep freed memory instead
# (the PyTorch CPU tuning guide's advice, without a preloaded allocator); about 1.8x faster steps here.
export MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1000000000000
start=$SECONDS
.venv/bin/python recipes/sweep.py recipes/configs/quick.yaml "${args[@]}" "$@"
for arg in "$@"; do  # a dry run lists the runs and runs none, --help runs none: nothing to report on
    [[ "$arg" != -h && "$arg" != --help ]] || exit 0
    [[ ${#arg} -lt 4 || --dry_run != "$arg"* ]] || exit 0  # argparse takes --dry for --dry_run
done
.venv/bin/python recipes/report.py runs/quick/runs
echo "main job: $((SECONDS - start)) s; report in runs/quick/report.md"
