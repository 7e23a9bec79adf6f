#!/usr/bin/env bash
# Create .venv and install gptlite into it (editable), with the test extra. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
# torch first, pinned to the release CI tests. TORCH_CPU=1 takes the CPU-only build from PyTorch's own index:
# on Linux the default build brings several GB of CUDA libraries that a machine without a GPU never uses.
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
if ! python -c "import torch" 2>/dev/null; then
    if [ "${TORCH_CPU:-0}" = 1 ]; then
        python -m pip install --quiet "torch==2.13.0" --index-url "$TORCH_CPU_INDEX"
    else
        python -m pip install --quiet "torch==2.13.0"
    fi
fi
# llama-cpp-python (the test extra's reference for GGUF files) compiles llama.cpp; its llava library is not needed.
# pip keeps the wheel it builds in its cache, so a second setup takes seconds.
CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF}" python -m pip install --quiet -e ".[test]"
python -c "import torch, gptlite; print(f'gptlite ready: torch {torch.__version__}, cuda {torch.cuda.is_available()}')"
