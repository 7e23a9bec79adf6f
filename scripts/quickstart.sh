#!/usr/bin/env bash
# gptlite's main job from nothing: set up .venv (torch and gptlite's own dependencies, nothing compiled), prepare
# tiny Shakespeare (char level), train a small model (a few minutes on a laptop CPU, less on a GPU), print samples.
#   bash scripts/quickstart.sh                                  # downloads tiny Shakespeare (1.1 MB)
#   SHAKESPEARE=path/to/tinyshakespeare.txt bash scripts/quickstart.sh    # offline: a copy you have
#   bash scripts/quickstart.sh --max_iters=500                  # arguments go to train.py
# Each corpus trains in a run folder of its own: out/quickstart (tiny Shakespeare) and, offline without a copy,
# out/quickstart_stdlib (Python's standard library). Running it again continues that corpus's run, or finds it
# finished and goes on to sample; a first run offline and a later one with SHAKESPEARE= keep both.
set -euo pipefail
if [ -n "${SHAKESPEARE:-}" ]; then
    if [ ! -f "$SHAKESPEARE" ]; then
        echo "quickstart: SHAKESPEARE=$SHAKESPEARE is not a file; give the path of your copy of tinyshakespeare.txt" >&2
        exit 2
    fi
    # the script runs from the checkout's root: a path relative to where it was started is made absolute first
    SHAKESPEARE="$(cd "$(dirname "$SHAKESPEARE")" && pwd)/$(basename "$SHAKESPEARE")"
fi
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if [ -n "${SHAKESPEARE:-}" ]; then
    python data/shakespeare/prepare.py --input="$SHAKESPEARE"
    DATA=data/shakespeare_char
    OUT=out/quickstart
    echo "corpus: tiny Shakespeare from $SHAKESPEARE"
elif python data/shakespeare/prepare.py; then
    DATA=data/shakespeare_char
    OUT=out/quickstart
    echo "corpus: tiny Shakespeare"
else
    # Offline: Python's own standard library is on every machine that runs this script.
    STDLIB=$(python -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
    DATA=data/python_stdlib_char
    OUT=out/quickstart_stdlib
    echo "corpus: tiny Shakespeare could not be downloaded (SHAKESPEARE=FILE names a copy you have), so training on Python's standard-library source ($STDLIB/*.py) in $OUT instead"
    python data/prepare.py --input "$STDLIB/*.py" --tokenizer=char --out_dir="$DATA"
fi
# A run folder that holds a run on other data (an offline run of a quick start from before each corpus had a folder
# of its own) is moved aside, whole: train.py would refuse to resume it on this data, and nothing in it is deleted.
TRAINED_ON=$(python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
try:  # run.json: what the run in the folder trained on; a file that is not one is train.py's to name
    print(json.loads((Path(sys.argv[1]) / "run.json").read_text())["config"]["data_dir"])
except (OSError, ValueError, KeyError, TypeError):
    print("")
PY
)
if [ -n "$TRAINED_ON" ] && [ "$TRAINED_ON" != "$DATA" ]; then
    N=1
    while [ -e "$OUT.$N" ]; do N=$((N + 1)); done
    mv "$OUT" "$OUT.$N"
    echo "quickstart: $OUT held a run on $TRAINED_ON, not $DATA: moved it to $OUT.$N (nothing deleted)"
fi
# --resume: run again, it continues an interrupted run (or finds the finished one and goes on to sample)
python train.py configs/shakespeare_char_cpu.toml --data_dir="$DATA" --out_dir="$OUT" --resume "$@"
python sample.py --model="$OUT" --num_samples=2 --max_new_tokens=300
