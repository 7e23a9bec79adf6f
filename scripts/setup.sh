#!/usr/bin/env bash
# Create .venv and install gptlite into it (editable), with the test extra. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
# torch first, pinned to the release CI tests. On a CPU-only Linux machine the CPU build is much
# smaller: pip install torch --index-url https://download.pytorch.org/whl/cpu (before this script).
python -c "import torch" 2>/dev/null || python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[test]"
python -c "import torch, gptlite; print(f'gptlite ready: torch {torch.__version__}, cuda {torch.cuda.is_available()}')"
