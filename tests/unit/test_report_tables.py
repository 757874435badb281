"""The report's benchmark table: one row per model, whatever else lies in the evaluation folders."""

from __future__ import annotations

import json

from apprentice.paths import Paths
from apprentice.stages.report import benchmark_table


def test_benchmark_table_has_a_row_per_model_and_none_for_timings(tmp_path):
    metrics = {"success_rate": 0.5, "success_ci_low": 0.2, "success_ci_high": 0.8, "mean_turns": 3.0}
    base = Paths(tmp_path, 1).benchmark_eval_dir
    base.mkdir(parents=True)
    (base / "base.json").write_text(json.dumps({**metrics, "success_rate": 0.0}))
    for k in (1, 2):
        d = Paths(tmp_path, k).eval_dir
        d.mkdir(parents=True)
        for m in ("student", "rl", "sft"):
            (d / f"{m}.json").write_text(json.dumps(metrics))
            (d / f"{m}.timings.json").write_text(json.dumps({"wall_s": 12.0, "episodes": 8}))  # beside, not a model
    rows = [line.split("  ")[0] for line in benchmark_table(Paths(tmp_path, 2)).splitlines()[2:]]
    assert rows == ["base", "iter 1 sft", "iter 1 rl", "iter 1 student", "iter 2 sft", "iter 2 rl", "iter 2 student"]
