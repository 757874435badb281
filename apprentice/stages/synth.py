"""Stage ``synth``: generate iteration k's training problem specs -> ``paths.problems``.

Which levels: from iteration 2 on (``frontier.mode: frontier``), the mix the frontier stage decided
from the champion's probe (family -> level -> count, :mod:`apprentice.curriculum.frontier`): most
problems where the champion half succeeds, some replay below, some above. Iteration 1 (and ``fixed``):
problem ``i`` goes to family ``families[i % F]`` at level ``levels[(i // F) % L]``, so every family
sees every level in turn. Problem ``i``'s seed is derived from (pipeline seed, synth seed, iteration, i):
the same config gives byte-identical Parquet files. Each family's ``generate(seed, level)``
accepts a problem only if its oracle earns reward 1.0 on replay.

Held out by content: the held-out problems are the fixed benchmark (``stages.benchmark``, one set
for all iterations). A training candidate whose task text + oracle plan equals a benchmark
problem's, or an earlier training problem's, is replaced by the next seed derived from its slot
(:func:`apprentice.stages.benchmark.generate_unique`): training never sees a benchmark problem under
another id, and holds no content duplicates; nor does it repeat a dev problem the frontier probed.

Selection (``synth.sampler``, iterations k > 1): generate ``n_train x synth.oversample`` training
candidates, predict the current model's pass rate on each *before any rollout* (the ex-ante
difficulty predictor, :mod:`apprentice.curriculum.difficulty`, fitted on iteration k-1's benchmark episodes of
the promoted candidate: only pass rates against difficulty features, no benchmark problem is
trained on) and keep the ``n_train`` that the curriculum sampler picks from those predictions.

Resumable: a manifest (``synth.json`` beside the outputs, written last) records a fingerprint of the
config section, the iteration, the benchmark and the generator source code, plus the outputs'
SHA-256; a rerun that finds matching outputs does nothing.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
from collections.abc import Callable
from pathlib import Path
from statistics import mean
from typing import Any

from tqdm.auto import tqdm

from apprentice.config import Config
from apprentice.curriculum import SAMPLER_SETTINGS, frontier, keep_predicted
from apprentice.data import dedupe, trajectories
from apprentice.data.trajectories import problems_frame, read_parquet, write_parquet
from apprentice.envs import FAMILIES, base, env_for, plugin_sources
from apprentice.envs.base import ProblemSpec, derive_seed
from apprentice.paths import Paths, atomic_path


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def fingerprint(cfg: Config, paths: Paths) -> str:
    """What the outputs are a function of: the synth section, the seeds, the generators' code."""
    sources: list[str | None] = [base.__file__, trajectories.__file__, dedupe.__file__, __file__]
    sources += [inspect.getsourcefile(FAMILIES[f]) for f in cfg.synth.families]
    code = {Path(s).name: _sha256(Path(s)) for s in sources if s}
    blob: dict[str, Any] = {"synth": cfg.synth.model_dump(mode="json"), "pipeline_seed": cfg.pipeline.seed,
                            "iteration": paths.iteration, "code": dict(sorted(code.items())),
                            "benchmark": _sha256(paths.benchmark) if paths.benchmark.exists() else None,
                            "frontier": (_sha256(paths.frontier_record) if cfg.frontier.mode == "frontier"
                                         and paths.iteration > 1 and paths.frontier_record.exists() else None)}
    if plugins := plugin_sources(cfg.synth.families):  # a plugin's package version and whole source
        blob["plugins"] = plugins
    if cfg.synth.sampler != "none":
        prev = previous_episodes(cfg, paths)
        blob["selection"] = {"curriculum": cfg.curriculum.model_dump(mode="json", include=set(SAMPLER_SETTINGS)),
                             "episodes": _sha256(prev) if prev else None}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


def plan(cfg: Config, iteration: int, split: str, n: int,
         mix: dict[str, dict[int, int]] | None = None) -> list[tuple[str, int, int]]:
    """(family, level, seed) for each of the ``n`` problems of ``split``: the frontier controller's
    ``mix`` (family -> level -> count) when given, else ``synth.levels`` round robin."""
    fams, levels = cfg.synth.families, cfg.synth.levels
    if mix:
        cells = frontier.slots({f: mix.get(f, {}) for f in fams})
        return [(*cells[i % len(cells)], derive_seed(cfg.pipeline.seed, cfg.synth.seed, iteration, split, i))
                for i in range(n)]
    return [(fams[i % len(fams)], levels[(i // len(fams)) % len(levels)],
             derive_seed(cfg.pipeline.seed, cfg.synth.seed, iteration, split, i)) for i in range(n)]


def frontier_mix(cfg: Config, paths: Paths) -> dict[str, dict[int, int]] | None:
    """The mix this iteration's frontier stage decided, from iteration 2 on under ``frontier.mode:
    frontier`` (iteration 1 and ``fixed`` keep the round robin over ``synth.levels``, exactly as before)."""
    if cfg.frontier.mode != "frontier" or paths.iteration == 1:
        return None
    from apprentice.stages.frontier import mix_of

    mix = mix_of(paths)
    if mix is None:
        raise FileNotFoundError(f"frontier.mode is frontier but {paths.frontier_record} does not exist; run "
                                f"`python -m apprentice frontier --iter {paths.iteration}` first (dvc repro does), "
                                "or set frontier.mode: fixed")
    return mix


def dev_keys(paths: Paths) -> set[str]:
    """Content keys of the frontier probe's dev problems: training never repeats them either."""
    if not paths.frontier_probe.exists():
        return set()
    from apprentice.stages import benchmark

    df = read_parquet(paths.frontier_probe)
    return benchmark.content_keys(df.drop_duplicates("problem_id")) if len(df) else set()


def _generator(family: str) -> Callable[[int, int], ProblemSpec]:
    cls = FAMILIES[family]
    gen = getattr(cls, "generate", None)
    if gen is None:
        raise ValueError(f"environment family '{family}' has no generate(seed, level) classmethod; add one")
    return gen




def previous_episodes(cfg: Config, paths: Paths) -> Path | None:
    """Iteration k-1's held-out episodes of the model training continues from: the champion promote-(k-1)
    named when iteration k-1 made it (an alternate such as SFT can win), else ``promote.candidate``, else
    the most-trained model evaluated; None in iteration 1."""
    prev = paths.previous()
    if prev is None:
        return None
    champ = prev.recorded_champion()  # none yet: the candidate it would have named
    mine = [champ[0]] if champ and champ[1].iteration == prev.iteration else []
    for name in dict.fromkeys([*mine, cfg.promote.candidate, "rl", "sft", "student"]):
        if (f := prev.eval_episodes(name)).exists():
            return f
    return None


def predict_pass_rates(episodes: Path, candidates: list[ProblemSpec]) -> tuple[Any, int]:
    """The ex-ante predictor fitted on ``episodes`` (``problem_id``, ``spec``, ``success``), applied to
    ``candidates``: (predicted pass rate per candidate, episodes fitted on). Raises ``ValueError``
    when the episodes are all successes or all failures."""
    from apprentice.curriculum import difficulty

    eps = read_parquet(episodes)
    specs = {pid: ProblemSpec.from_json(s) for pid, s in zip(eps["problem_id"], eps["spec"], strict=True)}
    feats = difficulty.feature_frame(list(specs.values()))
    model = difficulty.DifficultyPredictor().fit(feats.loc[eps["problem_id"]], eps["success"].astype(bool))
    return model.predict(difficulty.feature_frame(candidates)), len(eps)


def select_train(cfg: Config, candidates: list[ProblemSpec], episodes: Path | None,
                 n: int) -> tuple[list[int], dict[str, Any]]:
    """Indices (in generation order) of the ``n`` candidates ``synth.sampler`` keeps, and a summary.

    Pass rates are *predicted* (no rollout): a :class:`DifficultyPredictor` fitted on ``episodes``
    scores each candidate's spec; the sampler reads them as a pass-rate table. Falls back to the
    first ``n`` candidates (with the reason) when there is nothing to fit on; tops up in
    generation order when the sampler keeps fewer than ``n`` (a narrow band)."""
    first = list(range(min(n, len(candidates))))
    if episodes is None:
        return first, {"sampler": cfg.synth.sampler, "fallback": "no previous iteration's episodes"}
    try:
        pred, fitted = predict_pass_rates(episodes, candidates)
    except ValueError as e:  # all successes or all failures: no signal to fit
        return first, {"sampler": cfg.synth.sampler, "fallback": str(e).split(";")[0]}
    keep, picked, topped = keep_predicted(problems_frame(candidates, [0] * len(candidates), "train"), pred, n, cfg)
    kept_pred = [float(pred[i]) for i in keep]
    return keep, {"sampler": cfg.synth.sampler, "candidates": len(candidates), "picked": picked,
                  "topped_up": topped, "fitted_on": str(episodes.name), "fit_episodes": fitted,
                  "predicted_pass_rate_kept": round(sum(kept_pred) / len(kept_pred), 4) if kept_pred else None,
                  "predicted_pass_rate_all": round(float(pred.mean()), 4)}


def _is_done(cfg: Config, paths: Paths, fp: str) -> dict[str, Any] | None:
    m = paths.synth_manifest
    if not (m.exists() and paths.problems.exists()):
        return None
    try:
        info = json.loads(m.read_text())
    except json.JSONDecodeError:
        return None
    if info.get("fingerprint") != fp:
        return None
    if info.get("sha256") != {"problems": _sha256(paths.problems)}:
        return None
    return info


def run(cfg: Config, paths: Paths, **_: Any) -> dict[str, Any]:
    """Generate and write the training problems; return counts per family/level and mean oracle turns."""
    fp = fingerprint(cfg, paths)
    if (info := _is_done(cfg, paths, fp)) is not None:
        return {**info["summary"], "skipped": True}

    from apprentice.stages import benchmark

    held = benchmark.require(paths)
    from apprentice.envs.check import require_level_contract
    require_level_contract(cfg.synth.families, cfg.validate_.allow_non_monotone)
    n_train = cfg.synth.n_train
    if cfg.synth.sampler != "none":  # candidates to select from (see select_train)
        n_train = math.ceil(n_train * cfg.synth.oversample)
    mix = frontier_mix(cfg, paths)
    jobs = plan(cfg, paths.iteration, "train", n_train, mix)
    taken = benchmark.content_keys(held)  # training never repeats a benchmark problem's content
    taken |= dev_keys(paths)  # nor a problem the frontier probed the champion on
    n_held = len(taken)
    held_tasks = benchmark.task_keys(held)  # nor its task text (case, spacing, punctuation aside)
    with tqdm(total=len(jobs), desc=f"synth iter {paths.iteration}", unit="problem") as bar:
        specs: list[ProblemSpec] = []
        for job in jobs:
            specs += benchmark.generate_unique([job], taken, f"synth iteration {paths.iteration}", held_tasks)
            bar.update()

    selection: dict[str, Any] = {}
    if cfg.synth.sampler != "none":
        keep, selection = select_train(cfg, specs, previous_episodes(cfg, paths), cfg.synth.n_train)
        specs = [specs[i] for i in keep]
        jobs = [jobs[i] for i in keep]
    turns: dict[str, dict[str, list[int]]] = {}  # oracle plan lengths of the problems kept
    for (family, level, _seed), spec in zip(jobs, specs, strict=True):
        turns.setdefault(family, {}).setdefault(str(level), []).append(len(env_for(spec).oracle()))
    ids = [s.problem_id for s in specs]
    assert len(set(ids)) == len(ids), "synth: duplicate problem ids; change synth.seed"
    shared = set(ids) & set(held["problem_id"])
    assert not shared, f"synth: training shares problems {sorted(shared)[:3]} with the benchmark"

    frames = {"train": problems_frame(specs, [lv for _, lv, _ in jobs], "train")}
    write_parquet(frames["train"], paths.problems)

    counts = {split: {f: {str(lv): int(n) for lv, n in sorted(g.groupby("level").size().items())}
                      for f, g in sorted(df.groupby("family"))} for split, df in frames.items()}
    summary = {
        "iteration": paths.iteration,
        "train": len(specs),
        "benchmark": n_held,
        "counts": counts,
        "oracle_turns_mean": {f: {lv: round(mean(v), 2) for lv, v in sorted(d.items())}
                              for f, d in sorted(turns.items())},
        "problems": paths.rel(paths.problems),
        "benchmark_path": paths.rel(paths.benchmark),
        **({"selection": selection} if selection else {}),
        "mix": "frontier" if mix else "synth.levels",
    }
    manifest = {"fingerprint": fp, "summary": summary,
                "sha256": {"problems": _sha256(paths.problems)}}
    with atomic_path(paths.synth_manifest) as tmp:  # written last: its presence means "done"
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return {**summary, "skipped": False}
