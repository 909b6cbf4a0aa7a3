#!/usr/bin/env bash
# The tests selected by a marker expression, in two parts: in parallel (pytest-xdist, WORKERS
# workers, a module per worker so that its module-scoped jobs are shared), then those marked
# `serial` (verdicts on time measured in real jobs: tests/conftest.py) one at a time.
# Usage: ci/pytest_two_parts.sh PYTHON MARKER_EXPRESSION   (run from the checkout to test)
set -euo pipefail
python=$1
expr=$2
"$python" -m pytest -q -p no:cacheprovider -n "${WORKERS:-3}" --dist loadfile -m "($expr) and not serial"
"$python" -m pytest -q -p no:cacheprovider -m "($expr) and serial"
