#!/usr/bin/env bash
# One shortened iteration of the `gpu` profile on one GPU (target <= 8 min): synth -> teacher-rollout ->
# validate -> sft -> rl -> evaluate (sft, rl), printing each stage's wall time, generation and training
# tokens/s, and peak GPU memory (nvidia-smi sampled every second). Needs `pip install -e '.[gpu]'`.
#   MODEL=Qwen/Qwen2.5-0.5B-Instruct bash scripts/gpu_smoke.sh      # any HF id or local path
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-${VENV:-.venv}/bin/python}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-0}" TOKENIZERS_PARALLELISM=false DO_NOT_TRACK=true MLFLOW_DISABLE_TELEMETRY=true
ROOT="${SMOKE_ROOT:-runs/gpu-smoke}"
MODEL="${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}"
mkdir -p "$ROOT"
"$PY" -m apprentice.infra.gpu check --profile gpu || exit 1

SHORT=(--profile gpu --root "$ROOT" --set "model.base=$MODEL" --set synth.n_train=64 --set synth.n_eval=32
       --set sft.max_steps=20 --set sft.save_steps=20 --set rl.max_steps=4 --set rl.save_steps=4
       --set rl.probe_problems=16)
MEM_LOG="$ROOT/gpu_mem.csv"
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -l 1 >"$MEM_LOG" 2>/dev/null &
SMI=$!
trap 'kill $SMI 2>/dev/null || true' EXIT

run() {  # run <stage> [args...]: time it; training stages go through `accelerate launch` (apprentice.infra.gpu)
  local stage=$1; shift
  local t0; t0=$(date +%s.%N)
  if [[ $stage == sft || $stage == rl ]]; then
    read -r -a CMD <<<"$("$PY" -m apprentice.infra.gpu launch "$stage" --profile gpu)"
    "${CMD[@]}" "${SHORT[@]:2}" "$@"
  else
    "$PY" -m apprentice "$stage" "${SHORT[@]}" "$@"
  fi
  printf 'STAGE %-16s %7.1f s\n' "$stage${1:+ $*}" "$(echo "$(date +%s.%N) - $t0" | bc)" | tee -a "$ROOT/stage_times.txt"
}
: >"$ROOT/stage_times.txt"
T0=$(date +%s)
run synth
run teacher-rollout
run validate
run sft
run rl
run evaluate --policy sft
run evaluate --policy rl
kill $SMI 2>/dev/null || true
echo "=== gpu smoke: $(( $(date +%s) - T0 )) s total (target <= 480) ==="
cat "$ROOT/stage_times.txt"
"$PY" - "$ROOT" "$MEM_LOG" <<'PYEOF'
import json, pathlib, sys
root, mem = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
peak = max((int(x) for x in mem.read_text().split() if x.isdigit()), default=0)
print(f"peak GPU memory: {peak} MiB")
for name in ("sft", "rl"):
    f = root / "models" / "iter_1" / name / "metrics.jsonl"
    if f.exists():
        rows = [json.loads(l) for l in f.read_text().splitlines() if l.strip()]
        tps = [r.get("train_tokens_per_second") or r.get("tokens_per_second") for r in rows]
        tps = [t for t in tps if t]
        print(f"{name} training tokens/s: {sum(tps) / len(tps):.0f}" if tps else f"{name}: no tokens/s in metrics.jsonl")
for name in ("sft", "rl"):
    f = root / "data" / "iter_1" / "eval" / f"{name}.parquet"
    if f.exists():
        import pandas as pd
        df = pd.read_parquet(f)
        gen = int(df["completion_tokens"].sum()); wall = float(df["wall_s"].max()) or 1.0
        print(f"evaluate {name}: {gen} generated tokens in {wall:.1f} s = {gen / wall:.0f} tokens/s, success {df['success'].mean():.1%}")
PYEOF
