#!/usr/bin/env bash
# Set up (scripts/setup.sh), lint, and run the test suite. Offline: no Hub access is needed.
[ -n "${BASH_VERSION:-}" ] || { echo "test.sh: a bash script: run it as bash scripts/test.sh" >&2; exit 2; }
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's package, not one a PYTHONPATH holds
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check src tests benchmarks recipes
.venv/bin/python -m pytest "$@"
