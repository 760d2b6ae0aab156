#!/usr/bin/env bash
# The main job: set up, train the standard gradient and score:1000 (2 seeds each) on WikiText-2, and report.
#   bash scripts/compare.sh                                  # data and tokenizer from the Hub
#   SPANATTN_DATA=../shared/data bash scripts/compare.sh     # offline: local WikiText-2 + tokenizer
# Writes runs/quick/report.md, report.csv and the PNG figures. Extra arguments go to sweep.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
args=()
if [ -n "${SPANATTN_DATA:-}" ]; then
    export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
    wikitext="$SPANATTN_DATA/wikitext-2-raw-v1"
    train=train.txt
    [ -f "$wikitext/$train" ] || train=train.PARTIAL-first-1MB.txt
    args+=(--data_dir "$wikitext" --train_file "$train" --tokenizer_name "$SPANATTN_DATA/gpt2-tokenizer")
fi
start=$SECONDS
.venv/bin/python recipes/sweep.py recipes/configs/quick.yaml "${args[@]}" "$@"
.venv/bin/python recipes/report.py runs/quick/runs
echo "main job: $((SECONDS - start)) s; report in runs/quick/report.md"
