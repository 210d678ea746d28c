#!/usr/bin/env bash
# Idempotent fresh-machine set-up: system packages, then .venv with the project in editable mode.
# Usage: bash scripts/setup.sh   (make setup calls it when .venv is missing or out of date)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
VENV=.venv
CONSTRAINTS=requirements/constraints.txt

if ! command -v espeak-ng >/dev/null 2>&1; then
  echo "setup: installing espeak-ng (speech synthesis for demo and test data)"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup: espeak-ng is missing and apt-get is not available; install espeak-ng with your package manager" >&2
    exit 1
  fi
  $SUDO apt-get install -y espeak-ng >/dev/null 2>&1 || { $SUDO apt-get update >/dev/null && $SUDO apt-get install -y espeak-ng >/dev/null; }
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV with $("$PYTHON" --version)"
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
echo "setup: installing dflash_train and its pinned dependencies (a few minutes on a fresh machine)"
$PIP install -q -c "$CONSTRAINTS" -e '.[test]'
# nemo-automodel pins packages that conflict with NeMo; its DFlash classes need none of them.
$PIP install -q -c "$CONSTRAINTS" --no-deps nemo-automodel==0.7.0
"$VENV/bin/python" -c "import dflash_train, nemo.collections.speechlm2, nemo_automodel.components.speculative.dflash" \
  2>/dev/null || { echo "setup: import check failed" >&2; exit 1; }
touch "$VENV/.setup-complete"
echo "setup: done ($VENV)"
