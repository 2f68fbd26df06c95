#!/bin/sh
# Makes (once) a Python venv for rollbox's own SDK (sdk/python) and prints its python: the
# pinned sdk/python/requirements-test.txt (httpx, pytest) and the package in editable mode.
# Usage: scripts/sdk-venv.sh
# The venv lives outside the repository, keyed by the requirements and this checkout's path
# (an editable install points into one checkout):
#   ${ROLLBOX_SDK_VENV_DIR:-/var/cache/rollbox}/sdk-venv-HASH
# A venv whose install did not finish (no .complete marker) is made again.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
sdk="$root/sdk/python"
reqs="$sdk/requirements-test.txt"
hash=$( { cat "$reqs" "$sdk/pyproject.toml"; echo "$sdk"; } | sha256sum | cut -c1-16)
base=${ROLLBOX_SDK_VENV_DIR:-/var/cache/rollbox}
venv="$base/sdk-venv-$hash"
if [ ! -f "$venv/.complete" ]; then
    python=${PYTHON:-python3}
    command -v "$python" >/dev/null 2>&1 || { echo "sdk-venv: no $python on PATH" >&2; exit 1; }
    mkdir -p "$base"
    # Tests run in parallel: one makes the venv while the others wait, then find it made.
    exec 9>"$venv.lock"
    flock 9
fi
if [ ! -f "$venv/.complete" ]; then
    rm -rf "$venv"
    "$python" -m venv "$venv" >&2
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$reqs" >&2
    "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps \
        --no-build-isolation -e "$sdk" >&2
    "$venv/bin/python" -c "import httpx, pytest, rollbox_sdk" >&2
    touch "$venv/.complete"
fi
echo "$venv/bin/python"
