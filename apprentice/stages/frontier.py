"""Stage ``frontier``: probe the champion per family x level and decide iteration k's synthesis mix.

Iteration 1 has no champion yet (the base model solves nothing): its mix is ``synth.levels``, evenly,
as synthesis always did. From iteration 2 on, the champion that promote-(k-1) names plays
``frontier.probe_per_cell`` fresh *dev* problems per family and level (greedy, the evaluation's
settings), levels 0 to ``frontier.probe_above`` past the previous iteration's ceiling. The dev problems
have their own seed and are content- and task-disjoint from the benchmark (synthesis keeps training
disjoint from them in turn), so the decision never looks at the benchmark the champion is judged on.
:func:`apprentice.curriculum.frontier.decide` turns the pass rates into each family's window and mix.

Writes ``data/iter_k/frontier.parquet`` (the probe's episodes) and ``reports/iter_k/frontier.json`` (the
cells with Wilson intervals and status, the windows, the mixes, the ceilings; lineage logs its numbers).
A rerun with the same inputs reuses the probe (the record's fingerprint).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pandas as pd

from apprentice.config import Config, PolicyConfig
from apprentice.curriculum import frontier
from apprentice.paths import Paths, atomic_path

SPLIT = "dev"


def tops(cfg: Config) -> dict[str, int]:
    from apprentice.envs import resolve

    return {f: resolve(f).top_level() for f in cfg.synth.families}


def champion(paths: Paths) -> dict[str, Any] | None:
    """The champion entry of the previous promotion (None in iteration 1)."""
    from apprentice.stages.promote import previous_champion

    return None if paths.previous() is None else previous_champion(paths, "probes the champion")


def previous_ceilings(paths: Paths) -> dict[str, int]:
    prev = paths.previous()
    if prev is None or not prev.frontier_record.exists():
        return {}
    fams = json.loads(prev.frontier_record.read_text()).get("families") or {}
    return {f: int(d["ceiling"]) for f, d in fams.items() if "ceiling" in d}


def dev_problems(cfg: Config, paths: Paths, levels: dict[str, list[int]]) -> pd.DataFrame:
    """``probe_per_cell`` fresh problems per (family, level), disjoint from the benchmark by content and task."""
    from apprentice.data.trajectories import problems_frame
    from apprentice.envs.base import derive_seed
    from apprentice.stages import benchmark

    held = benchmark.require(paths)
    slots = [(f, lv, derive_seed(cfg.pipeline.seed, cfg.frontier.seed, paths.iteration, SPLIT, f, lv, j))
             for f in cfg.synth.families for lv in levels[f] for j in range(cfg.frontier.probe_per_cell)]
    specs = benchmark.generate_unique(slots, benchmark.content_keys(held), f"frontier probe {paths.iteration}",
                                      benchmark.task_keys(held))
    return problems_frame(specs, [lv for _, lv, _ in slots], "eval")


def probe(cfg: Config, paths: Paths, champ: dict[str, Any], problems: pd.DataFrame) -> pd.DataFrame:
    """The champion's greedy episodes on ``problems`` (the evaluation's engine and settings)."""
    from apprentice.data.trajectories import trajectories_frame
    from apprentice.infra.distributed import run_episodes
    from apprentice.policies.factory import build_policy, resolve_policy
    from apprentice.progress import enabled
    from apprentice.stages.promote import champion_path

    ec = cfg.evaluate
    default = PolicyConfig.model_validate({"kind": "hf", "temperature": ec.temperature,
                                           "max_new_tokens": ec.max_new_tokens, "batch_size": ec.batch_size})
    _, pol_cfg = resolve_policy(str(champion_path(champ, paths.root)), default, cfg, paths)
    trajs = run_episodes(problems, lambda: build_policy(pol_cfg, cfg, paths), engine=cfg.rollout.engine, ray=cfg.ray,
                         batch_size=ec.batch_size, seed=cfg.frontier.seed, progress=enabled(),
                         max_format_errors=ec.max_format_errors, max_repeats=ec.repeat_stop,
                         policy_id="frontier-probe")
    return trajectories_frame(trajs)


def _fingerprint(cfg: Config, paths: Paths, champ: dict[str, Any] | None) -> str:
    blob = {"frontier": cfg.frontier.model_dump(mode="json"), "families": cfg.synth.families,
            "levels": cfg.synth.levels, "n_train": cfg.synth.n_train, "iteration": paths.iteration,
            "seed": cfg.pipeline.seed, "champion": (champ or {}).get("md5"), "ceilings": previous_ceilings(paths),
            "evaluate": [cfg.evaluate.max_new_tokens, cfg.evaluate.temperature, cfg.evaluate.max_format_errors,
                         cfg.evaluate.repeat_stop, cfg.model.dtype, cfg.model.chat_template]}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


def run(cfg: Config, paths: Paths, **_: Any) -> dict[str, Any]:
    from apprentice.data.trajectories import trajectories_frame, write_parquet

    champ = champion(paths)
    fp = _fingerprint(cfg, paths, champ)
    rec = paths.frontier_record
    if rec.exists() and paths.frontier_probe.exists():
        old = json.loads(rec.read_text())
        if old.get("fingerprint") == fp:
            return {**old, "skipped": True}
    fams, top = cfg.synth.families, tops(cfg)
    if champ is None or cfg.frontier.mode == "fixed":
        episodes = trajectories_frame([])
        decision: dict[str, Any] = {
            "cells": [], "families": {f: {"mix": {str(k): v for k, v in m.items()}, "ceiling": max(m, default=0)}
                                      for f, m in frontier.fixed_mix(fams, cfg.synth.levels, cfg.synth.n_train).items()},
            "why": "iteration 1: no champion yet, synth.levels" if champ is None else "frontier.mode: fixed"}
    else:
        ceilings = previous_ceilings(paths)
        levels = {f: frontier.probe_levels(top[f], ceilings.get(f), cfg.frontier.probe_above) for f in fams}
        probe_set = dev_problems(cfg, paths, levels)
        episodes = probe(cfg, paths, champ, probe_set)
        lv_of = dict(zip(probe_set["problem_id"], probe_set["level"], strict=True))
        table = frontier.cells(episodes["family"], [lv_of[p] for p in episodes["problem_id"]], episodes["success"])
        fc = cfg.frontier
        decision = frontier.decide(table, fams, top, cfg.synth.n_train, target=fc.target, band=fc.band,
                                   replay_share=fc.replay_share, explore_share=fc.explore_share)
        decision["why"] = f"champion v{champ.get('version')} probed on {len(probe_set)} dev problems"
    write_parquet(episodes, paths.frontier_probe)
    record = {"iteration": paths.iteration, "mode": cfg.frontier.mode, "tops": top, "fingerprint": fp,
              "champion": None if champ is None else {k: champ.get(k) for k in ("version", "iteration", "kind")},
              "probe": paths.rel(paths.frontier_probe), "probe_success_rate":
                  round(float(episodes["success"].mean()), 4) if len(episodes) else None, **decision}
    with atomic_path(rec) as tmp:
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return {**record, "skipped": False}


def mix_of(paths: Paths) -> dict[str, dict[int, int]] | None:
    """Family -> level -> count from this iteration's ``frontier.json``, or None when there is none."""
    rec = Path(paths.frontier_record)
    if not rec.exists():
        return None
    fams = json.loads(rec.read_text()).get("families") or {}
    return {f: {int(lv): int(c) for lv, c in d.get("mix", {}).items()} for f, d in fams.items()}
