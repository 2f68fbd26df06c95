#!/usr/bin/env bash
# Starts a plain-HTTP Docker registry on 127.0.0.1:5000 (Debian package docker-registry) in the
# background, with its own config and storage, unless one already answers there. Waits until
# GET /v2/ answers. Idempotent; safe to call from several test runs. Installs docker-registry
# and curl with apt-get when they are missing (needs root).
#
#   scripts/start-registry.sh            # start (or reuse) and wait
#   scripts/start-registry.sh --stop     # stop the one this script started
#
# Environment: ROLLBOX_REGISTRY_ADDR (default 127.0.0.1:5000),
#              ROLLBOX_REGISTRY_DIR  (default /var/lib/rollbox-registry: config, storage, log, pid).
set -euo pipefail

addr="${ROLLBOX_REGISTRY_ADDR:-127.0.0.1:5000}"
dir="${ROLLBOX_REGISTRY_DIR:-/var/lib/rollbox-registry}"
pidfile="$dir/registry.pid"
logfile="$dir/registry.log"
url="http://$addr/v2/"

answers() {
    # /v2/ answers 200 (no auth) or 401 (auth configured): either way a registry is there.
    local code
    code="$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$url" 2>/dev/null || true)"
    [[ "$code" == 200 || "$code" == 401 ]]
}

if [[ "${1:-}" == "--stop" ]]; then
    if [[ -f "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
        kill "$(cat "$pidfile")"
        echo "registry: stopped (pid $(cat "$pidfile"))"
    fi
    rm -f "$pidfile"
    exit 0
fi

missing=()
command -v curl >/dev/null || missing+=(curl)
command -v docker-registry >/dev/null || missing+=(docker-registry)
if (( ${#missing[@]} )); then
    if [[ "$(id -u)" != 0 ]]; then
        echo "registry: missing ${missing[*]} (apt-get install -y ${missing[*]})" >&2
        exit 1
    fi
    echo "registry: installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}" >/dev/null
fi

if answers; then
    echo "registry: already answering at $url"
    exit 0
fi

registry_bin="$(command -v docker-registry || true)"
if [[ -z "$registry_bin" ]]; then
    echo "registry: docker-registry is not installed (apt-get install -y docker-registry)" >&2
    exit 1
fi

mkdir -p "$dir/storage"
cat > "$dir/config.yml" <<EOF
version: 0.1
log:
  level: warn
  fields:
    service: rollbox-registry
storage:
  filesystem:
    rootdirectory: $dir/storage
  delete:
    enabled: true
http:
  addr: $addr
  headers:
    X-Content-Type-Options: [nosniff]
EOF

# A registry this script started earlier but that no longer answers: replace it.
if [[ -f "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    kill "$(cat "$pidfile")" 2>/dev/null || true
    sleep 0.5
fi

# setsid: the registry outlives this script and the shell that ran it.
setsid "$registry_bin" serve "$dir/config.yml" >"$logfile" 2>&1 < /dev/null &
echo $! > "$pidfile"

for _ in $(seq 1 100); do
    if answers; then
        echo "registry: answering at $url (pid $(cat "$pidfile"), storage $dir/storage)"
        exit 0
    fi
    if ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then
        echo "registry: exited during start; log $logfile:" >&2
        tail -n 20 "$logfile" >&2 || true
        exit 1
    fi
    sleep 0.1
done
echo "registry: no answer at $url after 10 s; log $logfile:" >&2
tail -n 20 "$logfile" >&2 || true
exit 1
