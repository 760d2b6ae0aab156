#!/usr/bin/env bash
# Create .venv (once) and install hf_spanattn with its dev extras into it; a second call returns at once
# unless pyproject.toml, the torch pin or the checkout's folder changed.
# torch is pinned here, not in the package: a bare range would pull a multi-GB CUDA build.
[ -n "${BASH_VERSION:-}" ] || { echo "setup.sh: a bash script: run it as bash scripts/setup.sh" >&2; exit 2; }
set -euo pipefail
[ $# -eq 0 ] || { echo "setup.sh: takes no arguments, got $* (TORCH_VERSION=... picks another torch)" >&2; exit 2; }
cd "$(dirname "$0")/.."
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
stamp=.venv/.hf_spanattn-setup
want="$(sha256sum pyproject.toml | cut -d' ' -f1) torch==${TORCH_VERSION} $PWD"
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
echo "setting up .venv (the first time takes a few minutes)" >&2
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
PY=.venv/bin/python
# a venv made without pip (uv venv, venv --without-pip) or cut short before pip was in it
$PY -m pip --version >/dev/null 2>&1 || $PY -m ensurepip >/dev/null
$PY -m pip install -q --upgrade pip >/dev/null
# torch at the pinned version (a local build's +cpu and the like aside), else that version installed
$PY -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != sys.argv[1])" "$TORCH_VERSION" 2>/dev/null \
    || $PY -m pip install -q "torch==${TORCH_VERSION}"
$PY -m pip install -q -e ".[dev]"
echo "$want" > "$stamp"
