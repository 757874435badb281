"""Benchmark: our SFT stage (``apprentice.training.sft.train_sft``) against raw TRL ``SFTTrainer``.

Same model, same oracle trajectories, same TRL settings (the raw side gets the very ``trl.SFTConfig``
values our stage builds, minus our additions), same seed. What differs is everything the pipeline
adds around TRL: the ``Json``-typed dataset, the per-step metrics callback, checkpointing at
``save_steps``, the atomic final save. Step time = mean wall time of the optimizer steps after the
first (the first includes AdamW state allocation). Runs are interleaved A-B-B-A so slow drift on a
shared machine hits both sides equally; the target is a step-time ratio <= 1.05.

    python bench/sft_overhead.py                 # models/base (SmolLM2-135M), 6 steps per run
    python bench/sft_overhead.py --model models/tiny --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from transformers import TrainerCallback  # noqa: E402

from apprentice.config import SFTConfig  # noqa: E402
from apprentice.modeling import load_model, load_tokenizer  # noqa: E402


class StepTimer(TrainerCallback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._t = 0.0

    def on_step_begin(self, args, state, control, **kw):
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self._t)


def oracle_records(n: int) -> list[dict]:
    """``n`` validated-style teacher trajectories (grid + search oracle episodes)."""
    from apprentice.envs import FAMILIES
    from apprentice.policies.oracle import OraclePolicy
    from apprentice.rollout import run_episodes
    from apprentice.trajectories import problems_frame, to_sft_records, trajectories_frame

    specs = [FAMILIES[f].generate(1000 + i, level=i % 3) for i in range(n // 2) for f in ("grid", "search")]
    problems = problems_frame(specs, [0] * len(specs), "train")
    return to_sft_records(trajectories_frame(run_episodes(problems, OraclePolicy(), progress=False)))


def run_ours(model_dir: str, tok, records, sft: SFTConfig, dtype: str, out: Path) -> tuple[list[float], float]:
    from apprentice.training.sft import train_sft

    timer = StepTimer()
    t0 = time.perf_counter()
    train_sft(model_dir, tok, records, out / "ours", sft, dtype=dtype, callbacks=[timer])
    return timer.times, time.perf_counter() - t0


def run_raw(model_dir: str, tok, records, sft: SFTConfig, dtype: str, out: Path) -> tuple[list[float], float]:
    """Plain TRL as its docs show it: conversational dataset, SFTConfig, SFTTrainer, train, save_model.

    The dataset uses ``datasets.Json`` columns like ours: with plain Arrow structs the tool-call
    arguments of different tools merge (``{"direction": "up", "query": null}``) and the two sides
    would train on different tokens."""
    from datasets import Dataset, Features, Json, List
    from trl import SFTTrainer

    from apprentice.training.sft import sft_trl_config

    timer = StepTimer()
    t0 = time.perf_counter()
    args = sft_trl_config(sft, out / "raw", dtype)  # identical TRL values...
    args.save_strategy = "no"  # ...minus what the pipeline adds (checkpoints)
    model = load_model(model_dir, dtype="fp32")
    model.train()
    feats = Features({"messages": List(Json()), "tools": List(Json())})
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(list(records), features=feats),
                         processing_class=tok, callbacks=[timer])
    trainer.train()
    trainer.save_model(str(out / "raw" / "final"))
    return timer.times, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/base")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per run (>= 2)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--problems", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    model_dir = str((ROOT / args.model) if (ROOT / args.model).exists() else args.model)
    if not (Path(model_dir) / "config.json").exists():
        sys.exit(f"{model_dir} not found: run `python -m apprentice prepare-base` first (or pass --model)")
    tok = load_tokenizer(model_dir, "compact")
    records = oracle_records(args.problems)
    # same records for both sides; save_steps inside the run so our checkpointing cost is counted
    sft = SFTConfig(max_steps=args.steps, batch_size=args.batch_size, max_length=args.max_length,
                    save_steps=max(1, args.steps // 2))
    work = Path(tempfile.mkdtemp(prefix="sft-overhead-"))
    res: dict[str, list[tuple[list[float], float]]] = {"ours": [], "raw": []}
    try:
        for i, side in enumerate(["ours", "raw", "raw", "ours"]):  # ABBA
            fn = run_ours if side == "ours" else run_raw
            res[side].append(fn(model_dir, tok, records, sft, args.dtype, work / str(i)))
            shutil.rmtree(work / str(i), ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def step_mean(side: str) -> float:
        return statistics.mean(t for times, _ in res[side] for t in times[1:])

    def wall_mean(side: str) -> float:
        return statistics.mean(w for _, w in res[side])

    out = {
        "model": model_dir, "steps_per_run": args.steps, "batch_size": args.batch_size, "records": len(records),
        "ours_step_s": round(step_mean("ours"), 3), "raw_step_s": round(step_mean("raw"), 3),
        "step_time_ratio": round(step_mean("ours") / step_mean("raw"), 3),
        "ours_wall_s": round(wall_mean("ours"), 1), "raw_wall_s": round(wall_mean("raw"), 1),
        "wall_ratio": round(wall_mean("ours") / wall_mean("raw"), 3),
    }
    print(json.dumps(out, indent=2))
    print(f"SFT step-time ratio (ours / raw TRL): {out['step_time_ratio']:.3f}  (target <= 1.05)")


if __name__ == "__main__":
    main()
