"""``python -m apprentice evolve``: build generations 0..G of evolved problems and measure each one.

Outputs: one DVC output folder ``data/iter_k/evolve/`` and one DVC metrics file beside it
(``data/iter_k/evolve.json``; outside the folder because DVC forbids overlapping outputs):
  * ``evolve/gen_{g}.parquet``   the problems of generation g (problems-parquet schema; ``level`` = g,
                                 ``split`` = ``gen_g``; lineage in each spec's ``extra``);
  * ``evolve/reference.parquet`` one row per reference episode (generation, operator, success, turns);
  * ``evolve.json``              per generation: problems, reference pass rate with its 95 % Wilson
                                 interval, per-operator and per-family pass rates, and the one-sided
                                 Fisher p-value of the drop from g-1.

Generation 0 is seeded fresh for iteration 1; for iteration k > 1 it is the last generation of
iteration k-1 when that exists, so the environments keep evolving across iterations.
In the pipeline only while RL's generation scheduler reads the generations (``curriculum.evolve.feed`` > 0,
:mod:`apprentice.pipeline`); the CLI verb runs it whatever the params.
Resumable: a generation file that exists is read, not rebuilt (specs are deterministic anyway), and
a finished summary whose settings match is returned as is.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from apprentice.config import Config
from apprentice.data.trajectories import problems_frame, read_parquet, specs_of, write_parquet
from apprentice.envs.evolve import (
    derive_seed,
    direction_scores,
    evolve_generation,
    noisy_oracle_episode,
    seed_generation,
)
from apprentice.paths import Paths, atomic_path


def _wilson(k: int, n: int) -> tuple[float, float]:
    from apprentice.evaluation.metrics import wilson_interval

    return wilson_interval(k, n)


def _gen0(cfg: Config, paths: Paths) -> list:
    ev = cfg.curriculum.evolve
    prev = paths.previous()
    if prev is not None:
        last = prev.evolve_generation(ev.generations)
        if last.exists():
            return [s.__class__(s.family, s.seed, s.difficulty, 0, {**s.extra, "from_iter": prev.iteration})
                    for s in specs_of(read_parquet(last))]
    return seed_generation(ev.families or cfg.synth.families, ev.problems, derive_seed(ev.seed, "iter", paths.iteration))


def measure(specs: list, generation: int, ops: list[str | None], epsilon: float, samples: int,
            seed: int) -> pd.DataFrame:
    """Reference-policy episodes on one generation (seeded per generation, so reruns agree)."""
    rng = random.Random(derive_seed(seed, "reference", generation))
    rows = []
    for spec, op in zip(specs, ops, strict=True):
        for j in range(samples):
            ep = noisy_oracle_episode(spec, epsilon, rng)
            rows.append({"generation": generation, "problem_id": spec.problem_id, "family": spec.family,
                         "operator": op or "seed", "sample_idx": j, **ep, **direction_scores(spec)})
    return pd.DataFrame(rows)


def summarize(ref: pd.DataFrame) -> dict[str, Any]:
    from scipy.stats import fisher_exact

    gens: list[dict[str, Any]] = []
    for g, df in ref.groupby("generation"):
        k, n = int(df["success"].sum()), len(df)
        lo, hi = _wilson(k, n)
        row: dict[str, Any] = {"generation": int(g), "problems": int(df["problem_id"].nunique()), "episodes": n,
                               "pass_rate": k / n, "ci_low": lo, "ci_high": hi,
                               "mean_plan_len": float(df["plan_len"].mean()),
                               "by_operator": {op: float(d["success"].mean()) for op, d in df.groupby("operator")},
                               "by_family": {f: float(d["success"].mean()) for f, d in df.groupby("family")}}
        if gens:
            p = gens[-1]
            k0, n0 = round(p["pass_rate"] * p["episodes"]), p["episodes"]
            row["drop_p_value"] = float(fisher_exact([[k0, n0 - k0], [k, n - k]], alternative="greater")[1])
        gens.append(row)
    falls = all(b["pass_rate"] < a["pass_rate"] for a, b in zip(gens, gens[1:], strict=False))
    return {"generations": gens, "monotone_fall": falls,
            "pass_rate": {f"gen_{g['generation']}": g["pass_rate"] for g in gens}}  # flat: MLflow metrics


def run(cfg: Config, paths: Paths, **_: Any) -> dict[str, Any]:
    ev = cfg.curriculum.evolve
    settings = ev.model_dump()
    summary_path = paths.evolve_record
    if summary_path.exists():
        done = json.loads(summary_path.read_text())
        if done.get("settings") == settings:
            return done
    gens: list[tuple[list[Any], list[Any]]] = []
    g0 = paths.evolve_generation(0)
    specs = specs_of(read_parquet(g0)) if g0.exists() else _gen0(cfg, paths)
    if not g0.exists():
        write_parquet(problems_frame(specs, [0] * len(specs), "gen_0"), g0)
    gens.append((specs, [None] * len(specs)))
    for g in tqdm(range(ev.generations), desc="evolve", unit="gen"):
        path = paths.evolve_generation(g + 1)
        if path.exists():
            nxt = specs_of(read_parquet(path))
            ops = [s.extra.get("operator") for s in nxt]
        else:
            pairs = evolve_generation(gens[-1][0], g, ev.operators)
            nxt, ops = [p[0] for p in pairs], [p[1] for p in pairs]
            write_parquet(problems_frame(nxt, [g + 1] * len(nxt), f"gen_{g + 1}"), path)
        gens.append((nxt, ops))
    ref = pd.concat([measure(s, g, o, ev.reference_epsilon, ev.reference_samples, ev.seed)
                     for g, (s, o) in enumerate(gens)], ignore_index=True)
    write_parquet(ref, paths.evolve_reference)
    result = {"settings": settings, "out": paths.rel(paths.evolve_dir), **summarize(ref)}
    with atomic_path(summary_path) as tmp:
        tmp.write_text(json.dumps(result, indent=2))
    return result
