# Sourced by the scripts that make a cached Python venv and print its python
# (scripts/sdk-venv.sh, ray-venv.sh, e2b-venv.sh, e2b-ci-venv.sh):
#
#   make_venv NAME VENV CHECK EDITABLE PIP_ARGS...
#
# NAME is the log prefix; VENV the venv's path; CHECK a Python statement that proves the
# install (its imports); EDITABLE a package directory installed in editable mode after
# PIP_ARGS, without its dependencies ("" for none); PIP_ARGS what `pip install` gets.
# The venv is made once, under a lock (tests run in parallel and ask at once: one makes it,
# the others wait and find it made), and again when an install did not finish (no
# .complete marker). PYTHON picks the interpreter (default python3). POSIX sh.

make_venv() {
    venv_name=$1 venv=$2 venv_check=$3 venv_editable=$4
    shift 4
    venv_python=${PYTHON:-python3}
    if [ ! -f "$venv/.complete" ]; then
        command -v "$venv_python" >/dev/null 2>&1 || {
            echo "$venv_name: no $venv_python on PATH" >&2
            exit 1
        }
        mkdir -p "$(dirname "$venv")"
        exec 9>"$venv.lock"
        flock 9
    fi
    if [ ! -f "$venv/.complete" ]; then
        rm -rf "$venv"
        "$venv_python" -m venv "$venv" >&2
        "$venv/bin/pip" install --quiet --disable-pip-version-check "$@" >&2
        if [ -n "$venv_editable" ]; then
            "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps \
                --no-build-isolation -e "$venv_editable" >&2
        fi
        "$venv/bin/python" -c "$venv_check" >&2
        touch "$venv/.complete"
    fi
    echo "$venv/bin/python"
}
