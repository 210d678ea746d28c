#!/usr/bin/env bash
# Run the GPU check on a machine with one CUDA GPU and a stock PyTorch image (torch, lightning,
# transformers). Adds nemo_automodel and omegaconf (no dependencies: the image keeps its torch);
# this project is used from the checkout.
#   bash benchmarks/gpu_check.sh [--out report.json]
# With wheels carried over (no package index): WHEELS=/path/to/wheels bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=(python -m pip install -q --no-deps)
if [ -n "${WHEELS:-}" ]; then PIP+=(--no-index --find-links "$WHEELS"); fi
python -c "import nemo_automodel" 2>/dev/null || "${PIP[@]}" nemo-automodel==0.7.0
python -c "import omegaconf" 2>/dev/null || "${PIP[@]}" omegaconf antlr4-python3-runtime PyYAML
exec python benchmarks/gpu_check.py "$@"
