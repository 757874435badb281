#!/usr/bin/env bash
# `make serve-team`: the shared stores a small team (or a cluster) needs, on one host:
#   * MLflow tracking server over HTTP: sqlite backend (or MLFLOW_BACKEND=postgresql://...), proxied artifact root
#   * Prefect server (+ the scheduled deployment and a process worker, as `make serve`)
#   * a DVC remote: a directory here (DVC_REMOTE=/srv/dvc-remote), or s3://bucket/path for an S3-compatible store
# Other machines join with the three URLs this prints (docs/operations.md, "Shared stores"). Ctrl-C stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${VENV:-.venv}/bin"
STATE="${APPRENTICE_SERVE_DIR:-$PWD/.serve}"
HOST="${SERVE_HOST:-127.0.0.1}"            # 0.0.0.0 to accept other machines (put it behind your network's auth)
MLFLOW_PORT="${MLFLOW_PORT:-5000}"
PREFECT_PORT="${PREFECT_PORT:-4200}"
MLFLOW_BACKEND="${MLFLOW_BACKEND:-sqlite:///$STATE/mlflow.db}"
MLFLOW_ARTIFACTS="${MLFLOW_ARTIFACTS:-$STATE/mlartifacts}"
DVC_REMOTE="${DVC_REMOTE:-$STATE/dvc-remote}"
export DO_NOT_TRACK=true MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false DVC_NO_ANALYTICS=1
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false   # the job runner adds consumer processes nothing here uses
mkdir -p "$STATE" "$MLFLOW_ARTIFACTS"
[[ $DVC_REMOTE == *://* ]] || mkdir -p "$DVC_REMOTE"

PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done' EXIT
wait_http() {  # wait_http <url> <pid> <name> <log>
  for _ in $(seq 1 120); do
    curl -fs "$1" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || { echo "$3 died; see $4" >&2; exit 1; }
    sleep 1
  done
  echo "$3 did not answer $1 in 120 s; see $4" >&2; exit 1
}

"$BIN/mlflow" server --backend-store-uri "$MLFLOW_BACKEND" --artifacts-destination "$MLFLOW_ARTIFACTS" \
  --host "$HOST" --port "$MLFLOW_PORT" --workers 1 >"$STATE/mlflow.log" 2>&1 &
PIDS+=($!); wait_http "http://127.0.0.1:$MLFLOW_PORT/health" "${PIDS[-1]}" "mlflow server" "$STATE/mlflow.log"

"$BIN/python" -m dvc remote add --local --force --default team "$DVC_REMOTE" >/dev/null
"$BIN/python" -m dvc config --local core.analytics false

ADVERTISE="${SERVE_ADVERTISE:-$HOST}"
[[ $ADVERTISE == 0.0.0.0 ]] && ADVERTISE="$(hostname -f)"
cat <<MSG
shared stores are up:
  MLFLOW_TRACKING_URI=http://$ADVERTISE:$MLFLOW_PORT     (backend $MLFLOW_BACKEND, artifacts $MLFLOW_ARTIFACTS)
  PREFECT_API_URL=http://$ADVERTISE:$PREFECT_PORT/api
  dvc remote 'team' -> $DVC_REMOTE   (commit it for everyone: dvc remote add -d team $DVC_REMOTE)
MSG
# Prefect server, deployment and worker: the single-host recipe, unchanged (it stops the server on exit)
export PREFECT_PORT MLFLOW_TRACKING_URI="http://127.0.0.1:$MLFLOW_PORT"
bash scripts/serve.sh
