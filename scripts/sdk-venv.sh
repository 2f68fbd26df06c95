#!/bin/sh
# Makes (once) a Python venv for rollbox's own SDK (sdk/python) and prints its python: the
# pinned sdk/python/requirements-test.txt (httpx, pytest) and the package in editable mode.
# Usage: scripts/sdk-venv.sh
# The venv lives outside the repository, keyed by the requirements and this checkout's path
# (an editable install points into one checkout):
#   ${ROLLBOX_SDK_VENV_DIR:-/var/cache/rollbox}/sdk-venv-HASH
# A venv whose install did not finish (no .complete marker) is made again (scripts/lib/venv.sh).
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/scripts/lib/venv.sh"
sdk="$root/sdk/python"
reqs="$sdk/requirements-test.txt"
hash=$( { cat "$reqs" "$sdk/pyproject.toml"; echo "$sdk"; } | sha256sum | cut -c1-16)
base=${ROLLBOX_SDK_VENV_DIR:-/var/cache/rollbox}
make_venv sdk-venv "$base/sdk-venv-$hash" "import httpx, pytest, rollbox_sdk" "$sdk" -r "$reqs"
