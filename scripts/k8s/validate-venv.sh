#!/bin/sh
# Makes (once) a Python venv with kubernetes-validate (pinned; it carries the Kubernetes API's
# JSON schemas, so validating needs no API server and no network) and prints its python.
# Usage: scripts/k8s/validate-venv.sh
# The venv lives outside the repository, keyed by version:
#   ${ROLLBOX_SDK_VENV_DIR:-/var/cache/rollbox}/kubernetes-validate-VERSION
# A venv whose install did not finish (no .complete marker) is made again (scripts/lib/venv.sh).
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
. "$root/scripts/lib/venv.sh"
version=1.37.0
base=${ROLLBOX_SDK_VENV_DIR:-/var/cache/rollbox}
make_venv kubernetes-validate "$base/kubernetes-validate-$version" "import kubernetes_validate" "" \
    "kubernetes-validate==$version"
