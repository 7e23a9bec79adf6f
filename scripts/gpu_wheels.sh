#!/usr/bin/env bash
# Download the wheels a GPU machine without network needs for benchmarks/gpu_report.py (Python 3.12, x86-64 Linux):
# the server's packages (fastapi, uvicorn, llguidance: row serve) and those five test files import (gguf, openai,
# jsonschema: row tests), with their own needs, less the packages such a machine already has (KEEP_THEIRS), so that
# no second version shadows the machine's own. Install them there with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site
#   bash scripts/gpu_wheels.sh [DIR]        # default: .whl (ignored by git)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
WANTED=(fastapi uvicorn "llguidance>=1.9" gguf openai jsonschema)
# on the lent GPU machine's image: theirs is kept (typing_extensions is not in this list: pydantic needs a newer one)
KEEP_THEIRS="numpy pyyaml requests tqdm anyio idna attrs h11 click certifi charset_normalizer urllib3 annotated_doc"
mkdir -p "$DIR"
platforms=()
for tag in manylinux_2_17 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
python3 -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d "$DIR" "${WANTED[@]}"
for name in $KEEP_THEIRS; do
    rm -f "$DIR/$name"-[0-9]*.whl
done
echo "gpu_wheels: $(ls "$DIR"/*.whl | wc -l) wheels in $DIR ($(du -sh "$DIR" | cut -f1))"
