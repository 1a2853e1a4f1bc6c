#!/usr/bin/env bash
# Bring up a docker engine and the local base image the docker tests build on (as root).
# Idempotent: an engine that answers is left alone; a base image already imported is kept.
#
# No image registry is reachable on the CI machines, so the base image is made from Debian's
# own packages (debootstrap) and `docker import`ed: Python and its venv, nothing more. The
# tests' build installs offline from this machine's wheels (tests/docker/prepare.py), so it
# compiles nothing; a build that must (no wheelhouse) gets gcc and the headers in its build
# stage from Debian (docker/Dockerfile). Measured cold: minbase with gcc, GMP and Python
# headers and pip was 596 MB in 108 s (431 MB imported); without them, see .ci/run.
#
#   docker/ci_engine.sh            engine + base image (prints how long each step took)
#   BASE_IMAGE=name docker/ci_engine.sh   another tag for the base image
set -euo pipefail

BASE_IMAGE="${BASE_IMAGE:-fusionllm-base:bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
LOG="${DOCKERD_LOG:-/var/log/dockerd.log}"
ENGINE_WAIT_S=60

if [ "$(id -u)" != 0 ]; then
    echo "ci_engine.sh: needs root (apt-get, dockerd, debootstrap)" >&2
    exit 1
fi

seconds_since() { echo $(($(date +%s) - $1)); }

# apt may be busy (another job's apt-get holds the dpkg lock): wait for it, bounded.
apt_install() {
    local tries=30
    until DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null; do
        tries=$((tries - 1))
        if [ "$tries" = 0 ]; then
            echo "ci_engine.sh: apt-get install $* kept failing" >&2
            return 1
        fi
        sleep 10
    done
}

started=$(date +%s)
if ! command -v dockerd >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1; then
    apt-get update -qq >/dev/null || true
    apt_install docker.io debootstrap
    echo "ci_engine.sh: installed docker.io and debootstrap in $(seconds_since "$started") s"
fi

started=$(date +%s)
if docker info >/dev/null 2>&1; then
    echo "ci_engine.sh: docker engine already up"
else
    # No systemd here: dockerd runs in its own session so that it outlives this script.
    setsid dockerd >>"$LOG" 2>&1 </dev/null &
    deadline=$(($(date +%s) + ENGINE_WAIT_S))
    until docker info >/dev/null 2>&1; do
        if [ "$(date +%s)" -ge "$deadline" ]; then
            echo "ci_engine.sh: dockerd did not answer in ${ENGINE_WAIT_S} s; its log:" >&2
            tail -n 30 "$LOG" >&2
            exit 1
        fi
        sleep 1
    done
    echo "ci_engine.sh: started dockerd in $(seconds_since "$started") s (log: $LOG)"
fi

started=$(date +%s)
if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    echo "ci_engine.sh: base image $BASE_IMAGE already imported"
else
    root=$(mktemp -d /var/tmp/fusionllm-base.XXXXXX)
    trap 'rm -rf "$root" "$root.log"' EXIT
    debootstrap --variant=minbase \
        --include=python3,python3-venv,ca-certificates \
        bookworm "$root" "$MIRROR" >"$root.log" 2>&1 || {
        echo "ci_engine.sh: debootstrap failed; its log:" >&2
        tail -n 30 "$root.log" >&2
        exit 1
    }
    rm -f "$root.log"
    echo "ci_engine.sh: debootstrap took $(seconds_since "$started") s ($(du -sh "$root" | cut -f1))"
    started=$(date +%s)
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | docker import -c 'ENV LANG=C.UTF-8' - "$BASE_IMAGE" >/dev/null
    echo "ci_engine.sh: imported $BASE_IMAGE in $(seconds_since "$started") s"
fi
