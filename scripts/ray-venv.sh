#!/bin/sh
# Makes (once) a Python venv for rollbox_sdk.ray's tests and prints its python: what
# scripts/sdk-venv.sh installs (sdk/python/requirements-test.txt and the SDK, editable) plus
# the pinned Ray of sdk/python/requirements-ray.txt.
# Usage: scripts/ray-venv.sh
# The venv lives outside the repository, keyed by both requirement files, the SDK's
# pyproject.toml and this checkout's path:
#   ${ROLLBOX_SDK_VENV_DIR:-/var/cache/rollbox}/ray-venv-HASH
# A venv whose install did not finish (no .complete marker) is made again.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
sdk="$root/sdk/python"
hash=$( { cat "$sdk/requirements-test.txt" "$sdk/requirements-ray.txt" "$sdk/pyproject.toml"; echo "$sdk"; } | sha256sum | cut -c1-16)
base=${ROLLBOX_SDK_VENV_DIR:-/var/cache/rollbox}
venv="$base/ray-venv-$hash"
python=${PYTHON:-python3}
if [ ! -f "$venv/.complete" ]; then
    command -v "$python" >/dev/null 2>&1 || { echo "ray-venv: no $python on PATH" >&2; exit 1; }
    mkdir -p "$base"
    # Tests run in parallel: one makes the venv while the others wait, then find it made.
    exec 9>"$venv.lock"
    flock 9
fi
if [ ! -f "$venv/.complete" ]; then
    rm -rf "$venv"
    "$python" -m venv "$venv" >&2
    "$venv/bin/pip" install --quiet --disable-pip-version-check \
        -r "$sdk/requirements-test.txt" -r "$sdk/requirements-ray.txt" >&2
    "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps \
        --no-build-isolation -e "$sdk" >&2
    "$venv/bin/python" -c "import ray, httpx, pytest, rollbox_sdk" >&2
    touch "$venv/.complete"
fi
echo "$venv/bin/python"
