"""Stage ``loop-data``: the set iteration k's SFT trains on, mixed by the loop rule -> ``data/iter_k/train.parquet``.

Iteration 1 trains on its validated set as it is. Iteration k > 1 (``loop.rule``, :mod:`apprentice.training.loop_rules`):

* ``continue``: the new validated set + ``loop.replay_share`` of the set from earlier iterations' validated sets;
* ``restart``: the union of every iteration's validated set (SFT then starts from the base model);
* ``self``: as ``continue``, with ``loop.self_share`` of the new rows replaced by the champion's own
  episodes on the new problems that the environment verified (success) and the data gate keeps;
* ``repair``: as ``continue``, with ``loop.repair_share`` of the new rows replaced by the champion's
  failed episodes cut before their first error (:func:`apprentice.training.loop_rules.first_error`), replayed in a
  fresh environment and continued by the teacher (``rollout.teacher``); only the continuation is
  trained on (``context_turns``), and only continuations that succeed and pass the gate are kept.

Self-generated and repaired rows pass the same episode gate as teacher rows
(:func:`apprentice.gate.row_rejections`): nothing reaches SFT that validate would have excluded.
The champion's rollouts are written to ``data/iter_k/champion.parquet`` (empty for the other rules),
the summary (rows per source, the rule, what was excluded) to ``reports/iter_k/loop.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from apprentice.config import Config
from apprentice.data.trajectories import TRAJECTORY_COLUMNS, read_parquet, trajectories_frame, write_parquet
from apprentice.paths import Paths, atomic_path
from apprentice.training import loop_rules as loop


def earlier_sets(paths: Paths) -> list[pd.DataFrame]:
    """The validated sets of iterations 1..k-1 (each must exist: they are this stage's DVC deps)."""
    return [read_parquet(Paths(paths.root, j).sft_data) for j in range(1, paths.iteration)]


def _gate_kept(cfg: Config, df: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, int]]:
    """Rows of ``df`` the SFT gate keeps, and the excluded counts by check."""
    from apprentice.gate import row_rejections

    if df.empty:
        return df, {}
    rej = row_rejections(df, True, cfg.validate_.max_message_chars)
    why: dict[str, int] = {}
    for r in rej:
        if r is not None:
            why[r["check"]] = why.get(r["check"], 0) + 1
    return df.loc[[r is None for r in rej]].reset_index(drop=True), why


def champion_episodes(cfg: Config, paths: Paths, problems: pd.DataFrame) -> pd.DataFrame:
    """The champion's ``loop.samples`` episodes per problem at ``loop.temperature`` (the evaluation engine)."""
    from apprentice.infra.distributed import run_episodes
    from apprentice.policies.factory import build_policy, resolve_policy
    from apprentice.progress import enabled
    from apprentice.stages.sft import start_record

    champ = start_record(cfg, paths)["path"]
    _, pol_cfg = resolve_policy(champ, cfg.rollout.teacher.model_copy(update={"kind": "hf"}), cfg, paths)
    pol_cfg = pol_cfg.model_copy(update={"temperature": cfg.loop.temperature,
                                         "max_new_tokens": cfg.evaluate.max_new_tokens,
                                         "batch_size": cfg.evaluate.batch_size})
    trajs = run_episodes(problems, lambda: build_policy(pol_cfg, cfg, paths), engine=cfg.rollout.engine,
                         ray=cfg.ray, samples_per_problem=cfg.loop.samples, batch_size=cfg.evaluate.batch_size,
                         seed=cfg.loop.seed, progress=enabled(), max_format_errors=cfg.evaluate.max_format_errors)
    return trajectories_frame(trajs)


def repaired(cfg: Config, paths: Paths, failed: pd.DataFrame) -> pd.DataFrame:
    """The teacher's continuations of ``failed`` episodes from just before their first error."""
    from apprentice.envs import env_for
    from apprentice.envs.base import ProblemSpec
    from apprentice.policies.factory import build_policy, resolve_policy
    from apprentice.rollout.episodes import run_episodes

    if failed.empty:
        return trajectories_frame([])
    plans = {}
    for pid, spec in zip(failed["problem_id"], failed["spec"], strict=True):
        env = env_for(ProblemSpec.from_json(spec))
        plans[str(pid)] = [{"name": c.name, "arguments": dict(c.arguments)} for c in env.oracle()]
    cuts = loop.repair_starts(failed, plans)
    if not cuts:
        return trajectories_frame([])
    rows = failed.iloc[[pos for pos, _ in cuts]].reset_index(drop=True)
    _, teacher_cfg = resolve_policy(None, cfg.rollout.teacher, cfg, paths)
    teacher = build_policy(teacher_cfg, cfg, paths)
    problems = rows[["problem_id", "spec", "level"]]
    trajs = run_episodes(problems.assign(spec=rows["spec"]), teacher, starts=[s for _, s in cuts],
                         max_turns=cfg.rollout.max_turns, batch_size=teacher_cfg.batch_size, seed=cfg.loop.seed,
                         progress=False)
    df = trajectories_frame(trajs)
    df["sample_idx"] = rows["sample_idx"].to_numpy()  # one repair per failed episode: keep its identity
    df[loop.CONTEXT] = [int(json.loads(e).get("context_turns", 2)) for e in df["extra"]]
    return df


def build(cfg: Config, paths: Paths) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """(training rows, champion episodes, summary) of iteration k under ``loop.rule``."""
    lc, k = cfg.loop, paths.iteration
    new = read_parquet(paths.sft_data)
    champion = trajectories_frame([])
    # iteration 1 has no rule (nothing to continue from): the record says so, and its DVC stage does not
    # declare the loop params (``Stage.later_params``), so comparing rules keeps iteration 1 cached
    summary: dict[str, Any] = {"rule": lc.rule if k > 1 else "none (iteration 1)", "iteration": k,
                               "new_validated": len(new)}
    if k == 1:
        rows = loop._tagged(new, "teacher")
    elif lc.rule == "restart":
        rows = loop.union([loop._tagged(d, f"iter {j} teacher") for j, d in enumerate(earlier_sets(paths), 1)]
                          + [loop._tagged(new, "teacher")])
    else:
        fresh = loop._tagged(new, "teacher")
        if lc.rule in ("self", "repair"):
            problems = read_parquet(paths.problems).head(lc.problems)
            champion = champion_episodes(cfg, paths, problems)
            summary["champion_episodes"] = len(champion)
            summary["champion_success_rate"] = float(champion["success"].mean()) if len(champion) else None
            if lc.rule == "self":
                own, why = _gate_kept(cfg, champion.loc[champion["success"].astype(bool)].reset_index(drop=True))
                share, tag = lc.self_share, "self"
            else:
                fixes = repaired(cfg, paths, champion.loc[~champion["success"].astype(bool)].reset_index(drop=True))
                summary["repair_attempts"] = len(fixes)
                own, why = _gate_kept(cfg, fixes)
                share, tag = lc.repair_share, "repair"
            summary[f"{tag}_gate_excluded"] = why
            fresh, n_own = loop.mix(fresh, loop._tagged(own, tag), share, lc.seed)
            summary[f"{tag}_rows"] = n_own
        rows = loop.replay(fresh, [loop._tagged(d, f"iter {j} replay") for j, d in enumerate(earlier_sets(paths), 1)],
                           lc.replay_share, lc.seed)
    rows = rows.reset_index(drop=True)
    from apprentice.stages.sft import start_record

    start = start_record(cfg, paths)
    lr, warm = loop.sft_schedule(lc.rule, k, cfg.sft.learning_rate, lc.lr_factor, lc.warmup_steps,
                                 trained_start=start["version"] > 0)
    summary.update({"rows": len(rows), "by_source": {s: int(n) for s, n in rows[loop.SOURCE].value_counts().sort_index().items()},
                    "start": start["source"],
                    "sft_learning_rate": lr, "sft_warmup_steps": warm,
                    "sft_max_steps": loop.sft_steps(k, cfg.sft.max_steps, lc.max_steps)})
    return rows, champion, summary


def run(cfg: Config, paths: Paths, **_: Any) -> dict[str, Any]:
    from apprentice.gate import require_passed

    require_passed(paths.sft_data, paths.gate_record)
    for j in range(1, paths.iteration):
        prev = Paths(paths.root, j)
        require_passed(prev.sft_data, prev.gate_record)
    rows, champion, summary = build(cfg, paths)
    keep = [c for c in [*TRAJECTORY_COLUMNS, loop.CONTEXT, loop.SOURCE] if c in rows.columns]
    write_parquet(rows[keep], paths.train_data)
    write_parquet(champion, paths.champion_rollouts)
    with atomic_path(paths.loop_record) as tmp:
        tmp.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    print(json.dumps(summary, indent=1, sort_keys=True))
    return {**summary, "train": paths.rel(paths.train_data), "record": paths.rel(Path(paths.loop_record))}
