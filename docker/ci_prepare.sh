#!/usr/bin/env bash
# Everything the docker tests need before they start, made ahead (as root; .ci/run runs it in
# the background while the other tests run): the engine and base image (docker/ci_engine.sh)
# and, beside them (it needs no engine), the wheelhouse; then the tests' image
# (tests/docker/prepare.py). READY, a JSON file, is written last in every case: the image, or
# why there is none (the docker tests skip with it). Each step is bounded, so READY exists at
# most ENGINE_S + BUILD_S seconds after the start.
#
#   docker/ci_prepare.sh READY      (python: the environment the tests run in)
set -uo pipefail

READY=${1:?usage: docker/ci_prepare.sh READY}
ENGINE_S=600  # apt, dockerd, debootstrap: 2-4 min measured
BUILD_S=900   # wheelhouse and image build: 3-6 min measured under load
cd "$(dirname "$0")/.."
rm -f "$READY"

started=$(date +%s)
fail() {
    echo "ci_prepare.sh: $1" >&2
    printf '{"error": "%s"}\n' "$1" >"$READY.partial" && mv "$READY.partial" "$READY"
    exit 1
}
wheels=$(mktemp -d /var/tmp/fusionllm-wheels.XXXXXX) wheels_job=
trap '[ -z "$wheels_job" ] || kill "$wheels_job" 2>/dev/null; rm -rf "$wheels"' EXIT
# pip's downloads and the compile of an sdist, while debootstrap downloads and unpacks: 45-100
# s off the job. A wheelhouse that failed is not complete: the build then downloads. Bounded by
# the engine step's time, which it overlaps, so READY keeps its ENGINE_S + BUILD_S bound.
timeout "$ENGINE_S" python -m tests.docker.prepare --wheels-only --wheels "$wheels" &
wheels_job=$!
timeout "$ENGINE_S" docker/ci_engine.sh || fail "docker/ci_engine.sh failed or ran past ${ENGINE_S} s (exit $?)"
echo "ci_prepare.sh: engine and base image ready after $(($(date +%s) - started)) s"
wait "$wheels_job" || echo "ci_prepare.sh: no complete wheelhouse (exit $?): the build downloads" >&2
echo "ci_prepare.sh: wheelhouse and base image ready after $(($(date +%s) - started)) s"
timeout "$BUILD_S" python -m tests.docker.prepare --ready "$READY" --wheels "$wheels"
rc=$?
[ -s "$READY" ] || fail "the image build failed or ran past ${BUILD_S} s (exit $rc)"
echo "ci_prepare.sh: done after $(($(date +%s) - started)) s (exit $rc)"
