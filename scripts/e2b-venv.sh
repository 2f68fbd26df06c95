#!/bin/sh
# Makes (once) a Python venv with the stock `e2b` SDK from PyPI and prints its python.
# Usage: scripts/e2b-venv.sh [VERSION]   (default 2.63.0)
# The venv lives outside the repository, keyed by version:
#   ${ROLLBOX_E2B_VENV_DIR:-/var/cache/rollbox}/e2b-venv-VERSION
# A venv whose install did not finish (no .complete marker) is made again.
set -eu
version=${1:-2.63.0}
base=${ROLLBOX_E2B_VENV_DIR:-/var/cache/rollbox}
venv="$base/e2b-venv-$version"
python=${PYTHON:-python3}
if [ ! -f "$venv/.complete" ]; then
    command -v "$python" >/dev/null 2>&1 || { echo "e2b-venv: no $python on PATH" >&2; exit 1; }
    mkdir -p "$base"
    # Tests run in parallel: one makes the venv while the others wait, then find it made.
    exec 9>"$venv.lock"
    flock 9
fi
if [ ! -f "$venv/.complete" ]; then
    rm -rf "$venv"
    "$python" -m venv "$venv" >&2
    "$venv/bin/pip" install --quiet --disable-pip-version-check "e2b==$version" >&2
    "$venv/bin/python" -c "import e2b" >&2
    touch "$venv/.complete"
fi
echo "$venv/bin/python"
