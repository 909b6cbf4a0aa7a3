#!/usr/bin/env bash
# The tests selected by a marker expression, in two parts: in parallel (pytest-xdist, WORKERS
# workers, a module per worker so that its module-scoped jobs are shared), then those marked
# `serial` (verdicts on time measured in real jobs: tests/conftest.py) one at a time.
# A test that hangs past its timeout is ended by tests/conftest.py's backstop (its stacks dumped, its
# worker ended); xdist then runs what that worker had left on a fresh one, at most twice, and each
# part as a whole is cut off after PART_LIMIT_S (default 40 min), so that a hang fails the run with
# its stacks instead of using up CI's time in silence.
# Usage: ci/pytest_two_parts.sh PYTHON MARKER_EXPRESSION   (run from the checkout to test)
set -euo pipefail
python=$1
expr=$2
limit=${PART_LIMIT_S:-2400}
part() {
    local rc=0
    timeout -k 60 "$limit" "$python" -m pytest -q -p no:cacheprovider "$@" || rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "ci/pytest_two_parts.sh: pytest $* ran past ${limit} s and was stopped" >&2
    fi
    return "$rc"
}
part -n "${WORKERS:-3}" --dist loadfile --max-worker-restart 2 -m "($expr) and not serial"
part -m "($expr) and serial"
