#!/usr/bin/env bash
# Builds the root filesystem tarball of the `code-interpreter` template: a minimal Debian
# bookworm (debootstrap --variant=minbase) with Python 3, a venv at /opt/rollbox/code-interpreter
# holding ipykernel and jupyter-client from PyPI (pinned as in scripts/e2b-ci-venv.sh), and
# rollbox's code-interpreter server (scripts/e2b-code-interpreter-server.py) beside it.
# The template's start command is /opt/rollbox/code-interpreter/start, which serves E2B's
# `POST :49999/execute`; its ready command is /opt/rollbox/code-interpreter/ready.
#
# Usage:
#   scripts/code-interpreter-rootfs.sh                 # build or reuse; prints the tarball path last
#   scripts/code-interpreter-rootfs.sh --print-hash    # the cache key, nothing built
#
# Cache: $ROLLBOX_ROOTFS_CACHE (default /var/cache/rollbox/rootfs)/ci-<hash>/rootfs.tar, where
# <hash> is taken from this script, the server, scripts/lib/debian-rootfs.sh and the mirror. A build happens in a temporary
# directory and appears by rename; concurrent runs wait on a lock. Cold: about 2 minutes.
# Environment: ROLLBOX_DEBIAN_MIRROR (default http://deb.debian.org/debian); the host's pip
# settings (index, proxy, CA) apply to the wheel download.
# Needs root, python3-venv, debootstrap (installed with apt-get when missing) and network
# access to the mirror and to PyPI.
set -euo pipefail

script="$(realpath "${BASH_SOURCE[0]}")"
# shellcheck source=lib/debian-rootfs.sh
source "$(dirname "$script")/lib/debian-rootfs.sh"
readonly PIP_PACKAGES=("ipykernel==7.4.0" "jupyter-client==8.10.0")
readonly PREFIX=/opt/rollbox/code-interpreter
server="$(dirname "$script")/e2b-code-interpreter-server.py"
[[ -f "$server" ]] || die "no server at $server"
ROOTFS_NAME=code-interpreter-rootfs.sh
ROOTFS_KEY=ci-
ROOTFS_SUITE=bookworm
ROOTFS_PACKAGES=python3,python3-venv,ca-certificates,procps
ROOTFS_INPUTS=("$script" "$server")
ROOTFS_HELP="$(sed -n '2,20p' "$script" | sed 's/^# \{0,1\}//')"

customize() {
    local root="$1" work="$2"
    log "installing ${PIP_PACKAGES[*]}"
    # The wheels come through the host's pip (its proxy and CA settings apply), then install in
    # the chroot with no network.
    python3 -m venv "$work/download" || die "python3 -m venv on the host failed (apt-get install python3-venv)"
    "$work/download/bin/pip" download --quiet --disable-pip-version-check --only-binary=:all: \
        --implementation cp --python-version "$(chroot "$root" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform linux_x86_64 \
        -d "$root/tmp/wheels" "${PIP_PACKAGES[@]}" || die "pip download ${PIP_PACKAGES[*]} failed"
    mount -t proc proc "$root/proc"
    chroot "$root" python3 -m venv "$PREFIX" || die "python3 -m venv $PREFIX failed"
    chroot "$root" env -u PIP_FIND_LINKS PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
        "$PREFIX/bin/pip" install --quiet --no-index --find-links /tmp/wheels "${PIP_PACKAGES[@]}" \
        || die "pip install ${PIP_PACKAGES[*]} in the rootfs failed"
    chroot "$root" "$PREFIX/bin/python" -c "import ipykernel, jupyter_client" \
        || die "the rootfs's venv cannot import ipykernel and jupyter_client"
    umount "$root/proc"
    rm -rf "$root/tmp/wheels"
    install -m 0644 "$server" "$root$PREFIX/server.py"
    # The start command: the server on every address with its default kernel started, the kernel's
    # cwd /home/user (E2B's), its log in /var/log. The ready command: the server answers /health.
    cat > "$root$PREFIX/start" <<EOF
#!/bin/sh
export HOME="\${HOME:-/root}"
mkdir -p /home/user
exec $PREFIX/bin/python $PREFIX/server.py --host 0.0.0.0 --port 49999 --cwd /home/user --warm \\
    >>/var/log/code-interpreter.log 2>&1 </dev/null
EOF
    cat > "$root$PREFIX/ready" <<EOF
#!$PREFIX/bin/python
import urllib.request
urllib.request.urlopen("http://127.0.0.1:49999/health", timeout=5).read()
EOF
    chmod 0755 "$root$PREFIX/ready"
    chmod 0755 "$root$PREFIX/start"
}

describe() {
    echo "pip=${PIP_PACKAGES[*]}"
    echo "python=$(chroot "$1" python3 --version 2>&1 || echo unknown)"
}

debian_rootfs_main "$@"
