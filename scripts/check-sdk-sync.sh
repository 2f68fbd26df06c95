#!/bin/sh
# Fails, showing the difference, when sdk/python/rollbox_sdk/client.py is not what
# sdk/python/tools/unasync.py makes of aio.py (the sync client is generated from the async one).
# Usage: scripts/check-sdk-sync.sh       Fix: python3 sdk/python/tools/unasync.py
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
sdk="$root/sdk/python"
python=${PYTHON:-python3}
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
"$python" "$sdk/tools/unasync.py" --output "$tmp"
if ! diff -u "$sdk/rollbox_sdk/client.py" "$tmp"; then
    echo "check-sdk-sync: client.py is not generated from aio.py; run: $python sdk/python/tools/unasync.py" >&2
    exit 1
fi
echo "check-sdk-sync: client.py matches aio.py"
