#!/bin/sh
# Makes (once) a Python venv with the stock `e2b` SDK from PyPI and prints its python.
# Usage: scripts/e2b-venv.sh [VERSION]   (default 2.63.0)
# The venv lives outside the repository, keyed by version:
#   ${ROLLBOX_E2B_VENV_DIR:-/var/cache/rollbox}/e2b-venv-VERSION
# A venv whose install did not finish (no .complete marker) is made again (scripts/lib/venv.sh).
set -eu
. "$(cd "$(dirname "$0")" && pwd)/lib/venv.sh"
version=${1:-2.63.0}
base=${ROLLBOX_E2B_VENV_DIR:-/var/cache/rollbox}
make_venv e2b-venv "$base/e2b-venv-$version" "import e2b" "" "e2b==$version"
