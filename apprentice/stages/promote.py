"""Stage ``promote``: register the iteration's candidate and move the aliases.

Every evaluated candidate (``promote.candidate`` of iteration k, default the distilled student) is
registered in MLflow by reference and becomes ``challenger``. ``champion`` moves to it only when it
wins an exact McNemar test against the current champion on the *same* held-out episodes (matched by
problem id and sample) with ``p < promote.alpha``; otherwise the champion stays and the version,
the run and ``reports/iter_k/promotion.json`` record why. The first candidate of an empty registry
becomes champion. If the champion was never evaluated on this iteration's held-out problems, it is
evaluated here first (``reports/iter_k/champion_eval/``), so the pair is always like for like.

Both evaluation tables pass the ``eval_results`` gate before any alias moves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from apprentice import gates, lineage
from apprentice.config import Config
from apprentice.evaluation import paired_test
from apprentice.paths import Paths, atomic_path
from apprentice.trajectories import read_parquet

_MODEL_DIR = {"sft": "sft_model", "rl": "rl_model", "student": "student_model"}
_PRODUCER = {"sft": "sft", "rl": "rl", "student": "distill"}


def decide(challenger: pd.DataFrame | None, champion: pd.DataFrame | None, alpha: float,
           has_champion: bool) -> dict[str, Any]:
    """The promotion rule, kept pure for tests: ``{"promote": bool, "reason": str, ...test stats}``."""
    if not has_champion:
        return {"promote": True, "reason": "no champion yet: the first evaluated model becomes champion"}
    if challenger is None or champion is None:
        return {"promote": False, "reason": "champion has no evaluation on these problems; champion kept"}
    t = paired_test(challenger, champion)
    stats = {"p_value": t["p_value"], "challenger_only": t["a_only"], "champion_only": t["b_only"],
             "n_pairs": t["n_pairs"], "challenger_success": t["success_rate_a"],
             "champion_success": t["success_rate_b"]}
    if t["direction"] == "a" and t["p_value"] < alpha:
        return {"promote": True, "reason": f"challenger wins the paired test (p={t['p_value']:.4g} < {alpha})", **stats}
    why = ("challenger is not better" if t["direction"] != "a"
           else f"improvement not significant (p={t['p_value']:.4g} >= {alpha})")
    return {"promote": False, "reason": f"{why}; champion kept", **stats}


def _gate(df: pd.DataFrame, eval_ids: list[str], name: str) -> None:
    res = gates.check(df, "eval_results", {"eval_problem_ids": eval_ids}, table=name)
    gates.raise_if_failed([res])


def _champion_results(champ: dict[str, Any], challenger: pd.DataFrame, cfg: Config,
                      paths: Paths) -> pd.DataFrame | None:
    """The champion's episodes on the challenger's held-out problems.

    Its own evaluation table when that covers the same problems (evaluation sets repeat when the
    environments do not evolve); otherwise it is evaluated here; None if its weights are gone.
    """
    tags = champ["tags"]
    table = Path(tags.get("eval_table", ""))
    if table.is_file():
        df = read_parquet(table)
        if set(challenger["problem_id"]) <= set(df["problem_id"]):
            return df
    weights = Path(tags.get("root", paths.root)) / tags.get("weights_path", "")
    if not (weights / "config.json").exists():
        return None
    from apprentice.stages import evaluate

    res = evaluate.run(cfg, paths, policy=str(weights), out=str(paths.reports / "champion_eval"))
    return read_parquet(res["episodes"])


def run(cfg: Config, paths: Paths, **_: Any) -> dict[str, Any]:
    pc = cfg.promote
    cand = pc.candidate
    table = paths.eval_dir / f"{cand}.parquet"
    challenger = read_parquet(table)
    eval_ids = sorted(read_parquet(paths.eval_problems)["problem_id"].astype(str).unique())
    _gate(challenger, eval_ids, str(table))

    lineage.configure(cfg.lineage.tracking_uri, cfg.lineage.experiment, paths.root)
    name = pc.registered_model
    champ = lineage.alias_version(name, lineage.CHAMPION)
    champ_df = _champion_results(champ, challenger, cfg, paths) if champ else None
    if champ_df is not None:
        _gate(champ_df, eval_ids, "champion episodes")
    decision = decide(challenger, champ_df, pc.alpha, champ is not None)

    weights = getattr(paths, _MODEL_DIR[cand])
    rel = str(weights.relative_to(paths.root))
    lock = lineage.dvc_lock_entry(paths.root, f"{_PRODUCER[cand]}-{paths.iteration}")
    md5 = next((o.get("md5", "") for o in lock.get("outs", []) if o["path"] == rel), "")
    git = lineage.git_commit(paths.root)
    success = float(challenger["success"].mean())
    with lineage.attach_or_start(f"promote-{paths.iteration}",
                                 {lineage.TAG_ITER: str(paths.iteration)}) as run_id:
        version = lineage.register_reference(
            run_id, name, rel, paths.root, md5, git,
            {lineage.TAG_ITER: paths.iteration, lineage.TAG_KIND: cand, "root": str(paths.root),
             "success_rate": success, "eval_table": str(table)})
        lineage.set_alias(name, lineage.CHALLENGER, version)
        if decision["promote"]:
            lineage.set_alias(name, lineage.CHAMPION, version)
        record = {"promote.decision": "promoted" if decision["promote"] else "kept",
                  "promote.reason": decision["reason"], "promote.version": version,
                  "promote.champion_before": champ["version"] if champ else "none"}
        lineage.set_tags(run_id, record)
        lineage.tag_version(name, version, {"promotion": record["promote.decision"],
                                            "promotion_reason": decision["reason"]})
    champion_now = version if decision["promote"] or champ is None else champ["version"]
    out = {"registered_model": name, "version": int(version), "candidate": cand, "promoted": decision["promote"],
           "reason": decision["reason"], "champion_version": int(champion_now),
           "champion_before": int(champ["version"]) if champ else 0, "challenger_success": success,
           "weights_path": rel, "dvc_md5": md5,
           **{k: v for k, v in decision.items() if k not in ("promote", "reason")}}
    path = paths.reports / "promotion.json"
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"promotion: {name} v{version} ({cand}) -> {'champion' if decision['promote'] else 'challenger'}: "
          f"{decision['reason']}")
    return out
