#!/usr/bin/env bash
# Starts the host's dockerd (Debian package docker.io) in the background unless a daemon already
# answers, waits until `docker info` answers, and makes the local test image
# rollbox-test/busybox:latest (a `docker import` of busybox-static; no registry is needed).
# Idempotent; safe to call from several test runs.
#
#   scripts/start-dockerd.sh            # start (or reuse), wait, make the test image
#   scripts/start-dockerd.sh --stop     # stop the dockerd this script started
#
# Installs docker.io and busybox-static with apt-get when they are missing (needs root).
# Environment: ROLLBOX_DOCKERD_DIR     (default /var/run/rollbox-dockerd: pid file and log),
#              ROLLBOX_DOCKERD_TIMEOUT (seconds to wait for the daemon, default 60),
#              ROLLBOX_TEST_IMAGE      (default rollbox-test/busybox:latest).
set -euo pipefail

dir="${ROLLBOX_DOCKERD_DIR:-/var/run/rollbox-dockerd}"
timeout="${ROLLBOX_DOCKERD_TIMEOUT:-60}"
image="${ROLLBOX_TEST_IMAGE:-rollbox-test/busybox:latest}"
pidfile="$dir/dockerd.pid"
logfile="$dir/dockerd.log"

if [[ "${1:-}" == "--stop" ]]; then
    if [[ -f "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
        kill "$(cat "$pidfile")"
        echo "dockerd: stopped (pid $(cat "$pidfile"))"
    fi
    rm -f "$pidfile"
    exit 0
fi

answers() { timeout 10 docker info >/dev/null 2>&1; }

missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
# The image needs the static busybox (the dynamic one lacks its libraries inside the image).
dpkg -s busybox-static >/dev/null 2>&1 || missing+=(busybox-static)
if (( ${#missing[@]} )); then
    echo "dockerd: installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}" >/dev/null
fi

if answers; then
    echo "dockerd: already answering"
else
    mkdir -p "$dir"
    echo "dockerd: starting (log $logfile)"
    # setsid: the daemon outlives this script and its caller's process group.
    setsid dockerd --pidfile="$pidfile" >>"$logfile" 2>&1 < /dev/null &
    deadline=$((SECONDS + timeout))
    until answers; do
        if (( SECONDS >= deadline )); then
            echo "dockerd: no answer from 'docker info' within ${timeout}s; last log lines:" >&2
            tail -n 20 "$logfile" >&2 || true
            exit 1
        fi
        sleep 0.5
    done
    echo "dockerd: answering (pid $(cat "$pidfile" 2>/dev/null || echo '?'))"
fi

if docker image inspect "$image" >/dev/null 2>&1; then
    echo "dockerd: test image $image present"
    exit 0
fi
root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
mkdir -p "$root/bin" "$root/etc" "$root/tmp" "$root/root"
chmod 1777 "$root/tmp"
cp /bin/busybox "$root/bin/busybox"
for applet in $(/bin/busybox --list); do
    [[ "$applet" == busybox ]] || ln -s busybox "$root/bin/$applet"
done
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/sh\n' > "$root/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' > "$root/etc/group"
tar -C "$root" -c . | docker import --change 'ENV PATH=/bin' --change 'CMD ["/bin/sh"]' - "$image" >/dev/null
echo "dockerd: test image $image made from busybox-static"
