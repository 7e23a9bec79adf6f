#!/usr/bin/env bash
# gptlite's main job from nothing: set up .venv (torch and gptlite's own dependencies, nothing compiled), prepare
# tiny Shakespeare (char level), train a small model (a few minutes on a laptop CPU, less on a GPU), print samples.
#   bash scripts/quickstart.sh                                  # downloads tiny Shakespeare (1.1 MB)
#   SHAKESPEARE=path/to/tinyshakespeare.txt bash scripts/quickstart.sh    # offline: a copy you have
#   bash scripts/quickstart.sh --max_iters=500                  # arguments go to train.py
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if [ -n "${SHAKESPEARE:-}" ]; then
    python data/shakespeare/prepare.py --input="$SHAKESPEARE"
    DATA=data/shakespeare_char
    echo "corpus: tiny Shakespeare from $SHAKESPEARE"
elif python data/shakespeare/prepare.py; then
    DATA=data/shakespeare_char
    echo "corpus: tiny Shakespeare"
else
    # Offline: Python's own standard library is on every machine that runs this script.
    STDLIB=$(python -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
    echo "corpus: tiny Shakespeare could not be downloaded (SHAKESPEARE=FILE names a copy you have), so training on Python's standard-library source ($STDLIB/*.py) instead"
    DATA=data/python_stdlib_char
    python data/prepare.py --input "$STDLIB/*.py" --tokenizer=char --out_dir="$DATA"
fi
# --resume: run again, it continues an interrupted run (or finds the finished one and goes on to sample)
python train.py configs/shakespeare_char_cpu.toml --data_dir="$DATA" --out_dir=out/quickstart --resume "$@"
python sample.py --model=out/quickstart --num_samples=2 --max_new_tokens=300
