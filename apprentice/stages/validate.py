"""Stage ``validate``: the data gate between teacher rollout and training.

Runs the Great Expectations suites (``expectations/``) on the problems, the evaluation problems,
the teacher trajectories and the SFT set derived from them; writes ``reports/iter_k/gate.html``
(self-contained) and ``gate.json`` (DVC metrics) whether or not the gate passes, and writes the SFT
set (success-only when ``validate.success_only``) only when every suite passes. On a violation it
raises :class:`apprentice.gates.GateFailed`, so the CLI exits non-zero, ``dvc repro`` stops and
nothing downstream runs.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from apprentice import gates
from apprentice.config import Config
from apprentice.paths import Paths
from apprentice.trajectories import read_parquet, write_parquet


def sft_rows(teacher: pd.DataFrame, success_only: bool) -> tuple[pd.DataFrame, dict[str, int]]:
    """The SFT set drawn from the teacher rows, and how many rows each rule excluded (first reason
    that applies, in this order), so the iteration report can say what the gate left out and why."""
    failed = ~teacher["success"].astype(bool) if success_only else pd.Series(False, index=teacher.index)
    truncated = ~failed & teacher["truncated"].astype(bool)
    rest = ~failed & ~truncated
    # SFT learns only complete episodes whose every tool call is well-formed (the suite re-checks it).
    bad_calls = rest & ~gates.tool_calls_valid(teacher).reindex(teacher.index, fill_value=False)
    sft = teacher[rest & ~bad_calls].reset_index(drop=True)
    excluded = {"failed episode (validate.success_only)": int(failed.sum()), "truncated episode": int(truncated.sum()),
                "malformed tool call": int(bad_calls.sum())}
    return sft, excluded


def run(cfg: Config, paths: Paths, **_: Any) -> dict[str, Any]:
    v = cfg.validate_
    problems = read_parquet(paths.problems)
    eval_problems = read_parquet(paths.eval_problems)
    teacher = read_parquet(paths.teacher_trajectories)
    eval_ids = sorted(eval_problems["problem_id"].astype(str).unique())
    sft, _ = sft_rows(teacher, v.success_only)
    # Training data carries no wall-clock timings: a re-run teacher rollout with the same episodes then
    # yields a byte-identical SFT set, and DVC does not retrain SFT (10 min on CPU) for nothing.
    sft = sft.drop(columns=["wall_s"], errors="ignore")

    checks = [
        ("problems", problems, "problems", {"splits": ["train"], "forbidden_ids": eval_ids}),
        ("problems", eval_problems, "eval_problems", {"splits": ["eval", "test"], "forbidden_ids": []}),
        ("trajectories", teacher, "teacher trajectories",
         {"max_truncation_rate": v.max_truncation_rate, "min_success_rate": v.min_success_rate,
          "eval_problem_ids": eval_ids}),
        ("sft_data", sft, "sft set",
         {"allowed_success": [True] if v.success_only else [True, False], "eval_problem_ids": eval_ids}),
    ]
    results = [gates.check(df, suite, params, table=name)
               for suite, df, name, params in tqdm(checks, desc="validate", unit="suite")]
    html_path, json_path = paths.reports / "gate.html", paths.reports / "gate.json"
    gates.write_reports(results, html_path, json_path, f"Data gate, iteration {paths.iteration}")
    print("\n".join(r.summary() for r in results))
    gates.raise_if_failed(results, html_path)
    write_parquet(sft, paths.sft_data)
    return {"passed": True, "problems": len(problems), "eval_problems": len(eval_problems),
            "teacher_rows": len(teacher), "sft_rows": len(sft),
            "teacher_success_rate": float(teacher["success"].mean()),
            "truncation_rate": float(teacher["truncated"].mean()),
            "report": str(html_path)}
