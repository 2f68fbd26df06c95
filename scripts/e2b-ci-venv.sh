#!/bin/sh
# Makes (once) a Python venv with the stock `e2b-code-interpreter` SDK and the kernel our
# code-interpreter server (guest-image/code-interpreter/server.py) runs, from PyPI, pinned;
# prints its python. The venv lives outside the repository:
#   ${ROLLBOX_E2B_VENV_DIR:-/var/cache/rollbox}/e2b-ci-venv-2.11.5
# A venv whose install did not finish (no .complete marker) is made again.
set -eu
base=${ROLLBOX_E2B_VENV_DIR:-/var/cache/rollbox}
venv="$base/e2b-ci-venv-2.11.5"
python=${PYTHON:-python3}
if [ ! -f "$venv/.complete" ]; then
    command -v "$python" >/dev/null 2>&1 || { echo "e2b-ci-venv: no $python on PATH" >&2; exit 1; }
    mkdir -p "$base"
    # Tests run in parallel: one makes the venv while the others wait, then find it made.
    exec 9>"$venv.lock"
    flock 9
fi
if [ ! -f "$venv/.complete" ]; then
    rm -rf "$venv"
    "$python" -m venv "$venv" >&2
    "$venv/bin/pip" install --quiet --disable-pip-version-check \
        "e2b-code-interpreter==2.11.5" "e2b==2.63.0" \
        "ipykernel==7.4.0" "jupyter-client==8.10.0" >&2
    "$venv/bin/python" -c "import e2b_code_interpreter, ipykernel, jupyter_client" >&2
    touch "$venv/.complete"
fi
echo "$venv/bin/python"
