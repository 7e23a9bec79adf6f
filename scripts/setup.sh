#!/usr/bin/env bash
# Create .venv and install gptlite into it (editable). Safe to run again.
#   bash scripts/setup.sh            # what training, sampling and the other commands need: nothing compiles
#   bash scripts/setup.sh test       # ... and the test extra (references: transformers, llama.cpp, ...), as pip
#                                    # install -e ".[test]"; llama-cpp-python compiles llama.cpp (minutes, once)
#   TORCH_CPU=1 / TORCH_CPU=0        # torch's CPU-only build / torch from pip's index (PyPI: the default build,
#                                    # with CUDA's libraries). Unset: CPU-only where no NVIDIA GPU is found on
#                                    # Linux and PyTorch's CPU index answers, else pip's index. A .venv that
#                                    # already has torch keeps it, whichever build it is
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=${1:-}
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip

# torch first, pinned to the release CI tests. On Linux its default build brings several GB of CUDA libraries that
# a machine without a GPU never uses; PyTorch's own CPU index has the CPU-only build.
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
cpu_index_answers() {
    python - "$TORCH_CPU_INDEX" <<'EOF'
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1] + "/torch/", timeout=5)
except Exception:
    sys.exit(1)
EOF
}
if ! python -c "import torch" 2>/dev/null; then
    if [ -z "${TORCH_CPU:-}" ]; then
        TORCH_CPU=0
        if [ "$(uname -s)" = Linux ] && ! command -v nvidia-smi >/dev/null && [ ! -e /proc/driver/nvidia/version ]; then
            if cpu_index_answers; then
                TORCH_CPU=1
            else
                echo "setup: no NVIDIA GPU here, but PyTorch's CPU index ($TORCH_CPU_INDEX) did not answer: torch 2.13.0 from pip's own index, the build it serves (the line at the end names it)"
            fi
        fi
    fi
    if [ "$TORCH_CPU" = 1 ]; then
        echo "setup: torch 2.13.0, CPU-only build (no NVIDIA GPU found; TORCH_CPU=0 takes the default build)"
        python -m pip install --quiet "torch==2.13.0" --index-url "$TORCH_CPU_INDEX"
    else
        python -m pip install --quiet "torch==2.13.0"
    fi
fi

case "$EXTRAS" in
"")
    python -m pip install --quiet -e .
    ;;
test)
    # llama-cpp-python (the test extra's reference for GGUF files) compiles llama.cpp; its llava library is not
    # needed. pip keeps the wheel it builds in its cache, so a second setup takes seconds.
    CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF}" python -m pip install --quiet -e ".[test]"
    ;;
*)
    echo "setup.sh: unknown argument '$EXTRAS'; give nothing (what the commands need) or 'test' (the test extra)" >&2
    exit 2
    ;;
esac
python -c "import torch, gptlite; print(f'gptlite ready: torch {torch.__version__}, cuda {torch.cuda.is_available()}')"
