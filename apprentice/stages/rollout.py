"""Stage ``rollout`` (alias ``teacher-rollout``): the teacher plays every training problem.

Reads ``data/iter_k/problems.parquet``, builds the teacher from ``rollout.teacher`` (or
``--policy oracle|base|sft|rl|student|<path>``), runs ``rollout.samples_per_problem`` episodes per
problem with the batched engine and writes ``data/iter_k/teacher.parquet`` atomically.

Resumable: the output carries a fingerprint of what determines its episodes (problem specs, the
policy's model and sampling settings but not its URL, timeout or retries, model weights, seed, the
code, a plugin family's version and source) in its Parquet metadata; a rerun that finds a complete output with the same
fingerprint returns at once (:func:`apprentice.rollout.shards.fingerprint`); policies come from :mod:`apprentice.policies.factory`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from apprentice.config import Config
from apprentice.data.trajectories import read_parquet, write_parquet
from apprentice.evaluation.metrics import summarize
from apprentice.infra import distributed
from apprentice.paths import Paths
from apprentice.policies.factory import build_policy, resolve_policy
from apprentice.progress import enabled  # APPRENTICE_QUIET=1: no bars
from apprentice.rollout import shards


def run(cfg: Config, paths: Paths, policy: str | None = None, out: str | None = None,
        progress: bool = True) -> dict[str, Any]:
    problems = read_parquet(paths.problems)
    target = Path(out) if out else paths.teacher_trajectories
    rc = cfg.rollout
    name, pol_cfg = resolve_policy(policy, rc.teacher, cfg, paths)
    fp = shards.fingerprint(problems, pol_cfg, cfg, __name__, samples=rc.samples_per_problem, max_turns=rc.max_turns)
    n_rows = len(problems) * rc.samples_per_problem

    df = shards.existing_if_complete(target, fp, n_rows)
    skipped = df is not None
    if df is None:
        shards.check_writable(target.parent)  # before any episode runs
        built: list[Any] = []  # local engine: one policy for every shard; ray: each actor builds its own

        def make_policy() -> Any:
            if not built:
                pol = build_policy(pol_cfg, cfg, paths)
                if hasattr(pol, "max_reply_bytes"):  # an endpoint: the configured reply cap
                    pol.max_reply_bytes = pol_cfg.max_reply_bytes
                built.append(pol)
            return built[0]

        def chunk(rows: pd.DataFrame, seed: int, **resume: Any) -> list[Any]:  # resume: run_sharded's journal
            return distributed.run_episodes(rows, make_policy, engine=rc.engine, ray=cfg.ray, **resume,
                                            samples_per_problem=rc.samples_per_problem, max_turns=rc.max_turns,
                                            batch_size=pol_cfg.batch_size, progress=progress and enabled(), seed=seed)

        df, _ = shards.run_sharded(problems, chunk, target, fp, samples=rc.samples_per_problem, policy_id=name,
                                   shard_size=rc.shard_size, error_budget=rc.error_budget, seed=cfg.pipeline.seed)
        df.attrs[shards.FINGERPRINT_KEY] = fp
        write_parquet(shards.without_wall_clock(df), target)
        shards.write_timings(target, df)
        shards.clear(target, fp, rc.shard_size)
    m = summarize(df)
    return {"out": str(target), "policy": name, "skipped": skipped, "episodes": len(df),
            "success_rate": m["success_rate"], "success_ci": [m["success_ci_low"], m["success_ci_high"]],
            "truncation_rate": m["truncation_rate"], "mean_turns": m["mean_turns"]}
