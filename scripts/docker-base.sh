#!/usr/bin/env bash
# The base image of the pipeline Dockerfile, where no container registry is reachable.
#
#   bash scripts/docker-base.sh            # prints the image to pass as BASE (builds it once)
#
# Where a registry answers, `python:3.11-slim` is the ordinary base and is used as is. Otherwise:
# debootstrap a minimal Debian bookworm with python3 + venv from the Debian mirror apt already uses,
# and `docker import` it (built once, then reused).
set -euo pipefail
IMAGE="${APPRENTICE_BASE_IMAGE:-apprentice-base:bookworm}"
say() { echo "docker-base: $*" >&2; }

if docker image inspect "$IMAGE" >/dev/null 2>&1; then echo "$IMAGE"; exit 0; fi
if docker image inspect python:3.11-slim >/dev/null 2>&1 || timeout 60 docker pull -q python:3.11-slim >/dev/null 2>&1; then
  echo "python:3.11-slim"; exit 0
fi
[[ "$(id -u)" == 0 ]] || { say "no registry and not root: cannot debootstrap a base; run as root or docker load one"; exit 3; }
command -v debootstrap >/dev/null || { apt-get update -qq >&2; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >&2; }
MIRROR="$(grep -h -m1 -oE 'https?://[^ ]+/debian/?$' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null | head -n1 || true)"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
ROOT="$(mktemp -d /tmp/apprentice-rootfs.XXXXXX)"
trap 'rm -rf "$ROOT"' EXIT
say "debootstrap bookworm from $MIRROR (a few minutes, once)"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,make,git \
  bookworm "$ROOT" "$MIRROR" >&2
rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/*
tar -C "$ROOT" -c . | docker import -c 'ENV LANG=C.UTF-8' - "$IMAGE" >&2
say "built $IMAGE"
echo "$IMAGE"
