#!/bin/sh
# Makes (once) a Python venv for rollbox_sdk.ray's tests and prints its python: what
# scripts/sdk-venv.sh installs (sdk/python/requirements-test.txt and the SDK, editable) plus
# the pinned Ray of sdk/python/requirements-ray.txt.
# Usage: scripts/ray-venv.sh
# The venv lives outside the repository, keyed by both requirement files, the SDK's
# pyproject.toml and this checkout's path:
#   ${ROLLBOX_SDK_VENV_DIR:-/var/cache/rollbox}/ray-venv-HASH
# A venv whose install did not finish (no .complete marker) is made again (scripts/lib/venv.sh).
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/scripts/lib/venv.sh"
sdk="$root/sdk/python"
hash=$( { cat "$sdk/requirements-test.txt" "$sdk/requirements-ray.txt" "$sdk/pyproject.toml"; echo "$sdk"; } | sha256sum | cut -c1-16)
base=${ROLLBOX_SDK_VENV_DIR:-/var/cache/rollbox}
make_venv ray-venv "$base/ray-venv-$hash" "import ray, httpx, pytest, rollbox_sdk" "$sdk" \
    -r "$sdk/requirements-test.txt" -r "$sdk/requirements-ray.txt"
