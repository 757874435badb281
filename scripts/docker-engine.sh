#!/usr/bin/env bash
# A Docker engine for the sandboxed `shell` environments, the pipeline image and the Docker work pool.
#
#   eval "$(bash scripts/docker-engine.sh)"      # start (or reuse) an engine; exports DOCKER_HOST
#   bash scripts/docker-engine.sh stop           # stop the engine *this script* started (nothing else)
#   bash scripts/docker-engine.sh status         # exit 0 when an engine answers
#
# Why a script of our own: the machines this project runs on (CI included) may have the docker client
# but no engine, no systemd and no registry. So: use an engine that already answers ($DOCKER_HOST,
# then /var/run/docker.sock); else, as root, install Debian's `docker.io` once and start `dockerd`
# with settings that work in such a container (vfs storage: no overlayfs; no bridge and no iptables:
# sandboxes run with --network none anyway, builds use --network host). Idempotent: a second call finds the engine the first one started.
# The only line on stdout is `export DOCKER_HOST=unix://...`; progress goes to stderr.
set -euo pipefail

DIR="${APPRENTICE_DOCKER_DIR:-/var/lib/apprentice-docker}"
SOCK="$DIR/docker.sock"
PIDFILE="$DIR/dockerd.pid"
LOG="$DIR/dockerd.log"
OURS="unix://$SOCK"

say() { echo "docker-engine: $*" >&2; }
answers() { DOCKER_HOST="$1" timeout 10 docker info >/dev/null 2>&1; }

cmd="${1:-start}"
case "$cmd" in
  stop)
    if [[ -f "$PIDFILE" ]] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
      pid="$(cat "$PIDFILE")"
      kill "$pid"
      for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
      kill -0 "$pid" 2>/dev/null && { say "dockerd $pid did not stop in 30 s; kill -9"; kill -9 "$pid"; }
      say "stopped dockerd $pid"
    else
      say "no engine started by this script is running"
    fi
    exit 0 ;;
  status)
    for h in "${DOCKER_HOST:-}" "unix:///var/run/docker.sock" "$OURS"; do
      [[ -n "$h" ]] && answers "$h" && { echo "export DOCKER_HOST=$h"; exit 0; }
    done
    say "no engine answers"; exit 1 ;;
  start) ;;
  *) say "unknown command '$cmd'; use start, stop or status"; exit 2 ;;
esac

command -v docker >/dev/null 2>&1 || NEED_CLIENT=1
for h in "${DOCKER_HOST:-}" "unix:///var/run/docker.sock" "$OURS"; do
  if [[ -n "$h" && -z "${NEED_CLIENT:-}" ]] && answers "$h"; then
    say "using the engine at $h"
    echo "export DOCKER_HOST=$h"
    exit 0
  fi
done

if [[ "$(id -u)" != 0 ]]; then
  say "no Docker engine answers and this user is not root, so none can be started here;"
  say "start one (e.g. 'sudo dockerd') or set DOCKER_HOST to a running engine"
  exit 3
fi

PKGS=()
command -v dockerd >/dev/null 2>&1 && command -v docker >/dev/null 2>&1 || PKGS+=(docker.io)
command -v busybox >/dev/null 2>&1 || PKGS+=(busybox-static)   # the sandbox image is built from it
if ((${#PKGS[@]})); then
  say "installing Debian's ${PKGS[*]} (about a minute, once per machine)"
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${PKGS[@]}" >&2
fi

mkdir -p "$DIR/root"
# A stale pid file or socket from a killed dockerd must not block the new one.
if [[ -f "$PIDFILE" ]] && ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then rm -f "$PIDFILE" "$SOCK"; fi
say "starting dockerd (data root $DIR/root, log $LOG)"
# setsid + nohup: the engine outlives this script (and `make`), and the caller's Ctrl-C does not reach it.
setsid nohup dockerd --iptables=false --ip6tables=false --bridge=none --storage-driver=vfs \
  --data-root "$DIR/root" --exec-root "$DIR/exec" --host "$OURS" --pidfile "$PIDFILE" \
  >"$LOG" 2>&1 </dev/null &
for i in $(seq 1 60); do
  if answers "$OURS"; then
    say "engine ready after ${i} s"
    echo "export DOCKER_HOST=$OURS"
    exit 0
  fi
  sleep 1
done
say "dockerd did not answer in 60 s; last lines of $LOG:"
tail -n 20 "$LOG" >&2 || true
exit 4
