#!/usr/bin/env bash
# Download, here, the wheels scripts/gpu_sweep.sh installs on the bare GPU machine, into .whl/
# (ignored by git; name it in the run's carry). The machine has torch, transformers, accelerate,
# tokenizers, pyyaml, numpy, pandas, pyarrow, fsspec, xxhash, requests, tqdm, huggingface_hub:
# missing are datasets and evaluate, and of their needs dill and multiprocess. The versions are
# those the tests pass with here. Its Python is 3.12 on x86-64.
#   bash scripts/fetch_gpu_wheels.sh            # PYTHON=... to use another interpreter's pip
[ -n "${BASH_VERSION:-}" ] || { echo "fetch_gpu_wheels.sh: a bash script: run it as bash" \
                                     "scripts/fetch_gpu_wheels.sh" >&2; exit 2; }
set -euo pipefail
[ $# -eq 0 ] || { echo "fetch_gpu_wheels.sh: takes no arguments, got $* (PYTHON=... picks another" \
                       "interpreter)" >&2; exit 2; }
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
WHEELS=(datasets==5.2.0 evaluate==0.4.6 dill==0.4.1 multiprocess==0.70.19)
mkdir -p .whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${WHEELS[@]}"
ls -l .whl
