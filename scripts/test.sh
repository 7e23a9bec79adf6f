#!/usr/bin/env bash
# Set up .venv with the test extra (see setup.sh) and run the whole test suite on the CPU; arguments go to pytest:
#   bash scripts/test.sh -m "not slow"          # a quick subset: no tests that start processes or compile
#   bash scripts/test.sh tests/model/test_network.py -k rope    # what you name
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/python -m pytest -q "$@"
