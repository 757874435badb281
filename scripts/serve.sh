#!/usr/bin/env bash
# `make serve`: a local Prefect server, the scheduled deployment from prefect.yaml, and a worker.
# Ctrl-C stops the worker and the server. Runs land in the Prefect UI at http://127.0.0.1:4200.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${VENV:-.venv}/bin"
export PREFECT_HOME="${PREFECT_HOME:-$PWD/.prefect}"
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=true MLFLOW_DISABLE_TELEMETRY=true DVC_NO_ANALYTICS=1
PORT="${PREFECT_PORT:-4200}"
export PREFECT_API_URL="http://127.0.0.1:${PORT}/api"
POOL=apprentice-local
mkdir -p "$PREFECT_HOME"

"$BIN/prefect" server start --host "${SERVE_HOST:-127.0.0.1}" --port "$PORT" >"$PREFECT_HOME/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 90); do
  curl -fs "$PREFECT_API_URL/health" >/dev/null 2>&1 && break
  kill -0 $SERVER 2>/dev/null || { echo "prefect server died; see $PREFECT_HOME/server.log" >&2; exit 1; }
  sleep 1
done
curl -fs "$PREFECT_API_URL/health" >/dev/null || { echo "prefect server did not start in 90 s; see $PREFECT_HOME/server.log" >&2; exit 1; }
echo "Prefect UI: http://127.0.0.1:${PORT}   (runs: /runs, this deployment: /deployments, worker: /work-pools)"

"$BIN/prefect" work-pool inspect "$POOL" >/dev/null 2>&1 || "$BIN/prefect" work-pool create "$POOL" --type process
"$BIN/prefect" --no-prompt deploy --name nightly   # docker-quick needs the image: see docs/scaling-out.md, "Docker"
echo "deployment apprentice/nightly registered (cron 0 2 * * * UTC); run it now with:"
echo "  PREFECT_API_URL=$PREFECT_API_URL $BIN/prefect deployment run self-improve/nightly"
echo "inspect a run: Prefect UI -> Runs -> the run (task per stage, logs, timeline); its lineage:"
echo "  $BIN/mlflow ui --backend-store-uri sqlite:///$PWD/mlruns.db --port 5000   (http://127.0.0.1:5000)"
echo "  and the iteration's page: reports/iter_<k>/index.html"
"$BIN/prefect" worker start --pool "$POOL"
