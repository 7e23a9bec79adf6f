#!/usr/bin/env bash
# gptlite's main job from nothing: set up .venv, prepare tiny Shakespeare (char level), train a small
# model (a few minutes on a laptop CPU, less on a GPU), then print samples.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if python data/shakespeare/prepare.py; then
    DATA=data/shakespeare_char
    echo "corpus: tiny Shakespeare"
else
    # Offline: Python's own standard library is on every machine that runs this script.
    STDLIB=$(python -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
    echo "corpus: tiny Shakespeare could not be downloaded, so training on Python's standard-library source ($STDLIB/*.py) instead"
    DATA=data/python_stdlib_char
    python data/prepare.py --input "$STDLIB/*.py" --tokenizer=char --out_dir="$DATA"
fi
# --resume: run again, it continues an interrupted run (or finds the finished one and goes on to sample)
python train.py configs/shakespeare_char_cpu.toml --data_dir="$DATA" --out_dir=out/quickstart --resume "$@"
python sample.py --out_dir=out/quickstart --num_samples=2 --max_new_tokens=300
