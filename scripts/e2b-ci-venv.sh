#!/bin/sh
# Makes (once) a Python venv with the stock `e2b-code-interpreter` SDK and the kernel our
# code-interpreter server (guest-image/code-interpreter/server.py) runs, from PyPI, pinned;
# prints its python. The venv lives outside the repository:
#   ${ROLLBOX_E2B_VENV_DIR:-/var/cache/rollbox}/e2b-ci-venv-2.11.5
# A venv whose install did not finish (no .complete marker) is made again (scripts/lib/venv.sh).
set -eu
. "$(cd "$(dirname "$0")" && pwd)/lib/venv.sh"
base=${ROLLBOX_E2B_VENV_DIR:-/var/cache/rollbox}
make_venv e2b-ci-venv "$base/e2b-ci-venv-2.11.5" \
    "import e2b_code_interpreter, ipykernel, jupyter_client" "" \
    "e2b-code-interpreter==2.11.5" "e2b==2.63.0" "ipykernel==7.4.0" "jupyter-client==8.10.0"
