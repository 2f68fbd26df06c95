#!/bin/sh
# Makes (once) a Python venv with schemathesis (API fuzzing against docs/api/openapi.yaml) from PyPI and prints its python.
# Usage: scripts/schemathesis-venv.sh [VERSION]   (default 4.32.5)
# The venv lives outside the repository, keyed by version:
#   ${ROLLBOX_SCHEMATHESIS_VENV_DIR:-/var/cache/rollbox}/schemathesis-venv-VERSION
# A venv whose install did not finish (no .complete marker) is made again.
set -eu
version=${1:-4.32.5}
base=${ROLLBOX_SCHEMATHESIS_VENV_DIR:-/var/cache/rollbox}
venv="$base/schemathesis-venv-$version"
if [ ! -f "$venv/.complete" ]; then
    python=${PYTHON:-python3}
    command -v "$python" >/dev/null 2>&1 || { echo "schemathesis-venv: no $python on PATH" >&2; exit 1; }
    mkdir -p "$base"
    rm -rf "$venv"
    "$python" -m venv "$venv" >&2
    "$venv/bin/pip" install --quiet --disable-pip-version-check "schemathesis==$version" >&2
    "$venv/bin/python" -c "import schemathesis" >&2
    touch "$venv/.complete"
fi
echo "$venv/bin/python"
