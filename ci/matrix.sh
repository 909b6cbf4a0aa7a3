#!/usr/bin/env bash
# The version matrix, beside `make test` (Python 3.11 + the local torch 2.13 CPU build):
#   - the oldest supported torch on the oldest supported Python, and the newest torch on the index
#     with the newest Python, each in a fresh venv (the index's wheels are CUDA builds: run on the
#     CPU here; their downloads and venvs are cached in $COMMPATCH_MATRIX_CACHE between runs);
#   - the suite once more with the C recorder not built (the pure-Python hot path).
# The venv cells run the tests marked `torch` (those that touch torch's own API: tests/conftest.py);
# the pure cell leaves out those marked `offline` (files and synthetic logs only) and `slow` (more
# jobs, not more paths of the recorder), which `make test` / `make test-slow` run.
# Usage: ci/matrix.sh [cell ...]   cells: oldest newest pure (default: all three)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
CACHE=${COMMPATCH_MATRIX_CACHE:-$HOME/.cache/commpatch-matrix}
PYENV_ROOT=${PYENV_ROOT:-$HOME/.pyenv}
PIP_FLAGS=(--disable-pip-version-check -q)
mkdir -p "$CACHE"
# each venv cell pins its torch exactly: a machine-wide pip cap (this image's /etc/xdg/pip
# constraints.txt: torch<=2.14.1, the releases on its disk) must not refuse the newest cell's pin
: > "$CACHE/no-constraints.txt"
export PIP_CONSTRAINT="$CACHE/no-constraints.txt"

# cell name -> "python minor version, torch version": the declared support range's two ends
declare -A CELLS=([oldest]="3.9 2.4.1" [newest]="3.13 2.15.0")

python_for() {      # the newest installed patch release of a Python minor version (pyenv), or fail
    local minor=$1 found
    found=$(ls -d "$PYENV_ROOT"/versions/"$minor".* 2>/dev/null | sort -V | tail -n 1)
    if [ -z "$found" ] || [ ! -x "$found/bin/python" ]; then
        found=$(command -v "python$minor" || true)
        [ -n "$found" ] || { echo "matrix: no Python $minor (pyenv root $PYENV_ROOT)" >&2; return 1; }
        echo "$found"; return 0
    fi
    echo "$found/bin/python"
}

venv_cell() {       # name: a venv with that Python and torch, commpatch installed editable, then the suite
    local name=$1 minor torch py tag wheels venv
    read -r minor torch <<<"${CELLS[$name]}"
    py=$(python_for "$minor")
    tag="py$("$py" -c 'import sys; print("%d%d" % sys.version_info[:2])')-torch$torch"
    wheels="$CACHE/wheels-$tag"
    venv="$CACHE/venv-$tag"
    if [ ! -f "$wheels/.complete" ]; then
        echo "matrix[$name]: downloading torch==$torch for $("$py" --version) into $wheels"
        "$py" -m pip download "${PIP_FLAGS[@]}" -d "$wheels" "torch==$torch"
        touch "$wheels/.complete"
    fi
    if [ ! -f "$venv/.complete" ]; then
        rm -rf "$venv"
        "$py" -m venv "$venv"
        "$venv/bin/python" -m pip install "${PIP_FLAGS[@]}" --no-index --find-links "$wheels" "torch==$torch"
        touch "$venv/.complete"
    fi
    "$venv/bin/python" -m pip install "${PIP_FLAGS[@]}" -e "$REPO[test]"
    "$venv/bin/python" -m commpatch install-hook >/dev/null
    echo "matrix[$name]: $("$venv/bin/python" --version), torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
    # CI_MATRIX_CELL: the README support-table test then fails (not skips) when the torch has no row
    # the tests that touch torch's own API (marker `torch`, tests/conftest.py), in parallel but for
    # those that measure time (`serial`)
    (cd "$REPO" && CI_MATRIX_CELL=$name "$REPO/ci/pytest_two_parts.sh" "$venv/bin/python" "torch")
}

pure_cell() {       # the suite on a copy of the checkout without the compiled C recorder
    local copy
    copy=$(mktemp -d)
    trap 'rm -rf "$copy"' RETURN
    git -C "$REPO" ls-files -z | (cd "$REPO" && xargs -0 cp --parents -t "$copy")
    (cd "$copy" && PYTHONPATH=$copy python3 -c \
        'from commpatch.record import rows; assert rows._hot is None, "the C recorder is built here"')
    echo "matrix[pure]: the suite with the pure-Python recorder"
    # the recorder's paths are those of every recording test: the multi-process `slow` ones add jobs, not paths
    (cd "$copy" && "$REPO/ci/pytest_two_parts.sh" python3 "not offline and not slow")
}

if [ "${1:-}" = "--one" ]; then       # one cell, in a process of its own: set -e holds inside it
    case "$2" in
        pure) pure_cell ;;
        *) venv_cell "$2" ;;
    esac
    exit 0
fi
cells=("$@")
[ ${#cells[@]} -gt 0 ] || cells=(oldest newest pure)
for cell in "${cells[@]}"; do
    case "$cell" in
        pure|oldest|newest) ;;
        *) echo "matrix: unknown cell '$cell' (oldest, newest, pure)" >&2; exit 2 ;;
    esac
done
failed=()
for cell in "${cells[@]}"; do      # every cell runs, whatever an earlier one gave; the status at the end
    start=$(date +%s)
    status=0
    "$REPO/ci/matrix.sh" --one "$cell" || status=$?
    echo "matrix[$cell]: $([ $status -eq 0 ] && echo passed || echo "FAILED (exit $status)") in $(( $(date +%s) - start )) s"
    [ $status -eq 0 ] || failed+=("$cell")
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "matrix: failed cells: ${failed[*]}" >&2
    exit 1
fi
