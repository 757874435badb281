"""Stage ``benchmark``: the fixed held-out problem set every model of every iteration is scored on.

Why one fixed set and not a fresh held-out split per iteration: promotion compares a challenger with
a champion from an earlier iteration, and a learning table across iterations compares models
trained at different times. Both need the *same* problems; a per-iteration split would force the
champion to be re-evaluated and make iteration tables incomparable. So the benchmark is
synthesized once (its own seed, ``benchmark.seed``, independent of ``pipeline.seed`` and
``synth.seed``; every family trained on at every level, round-robin), lives outside ``iter_k``
(``data/benchmark/problems.parquet``) and never changes while its params do not: an unchanged model
on the unchanged benchmark is a DVC cache hit.

Never trained on: synthesis of every iteration excludes any training candidate whose *content*
(task text + oracle plan, :func:`apprentice.data.dedupe.spec_content_key`) equals a benchmark problem's,
not only its id; the benchmark itself holds no two problems with the same content.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Set
from typing import Any

import pandas as pd

from apprentice.config import Config
from apprentice.data.dedupe import spec_content_key as content_key
from apprentice.data.dedupe import spec_task_key
from apprentice.data.trajectories import problems_frame, read_parquet, specs_of, write_parquet
from apprentice.envs import resolve
from apprentice.envs.base import ProblemSpec, derive_seed
from apprentice.paths import Paths, atomic_path

SPLIT = "benchmark"
#: Seeds tried per slot before giving up on finding a problem whose content is new.
MAX_TRIES = 40


def plan(cfg: Config) -> list[tuple[str, int, int]]:
    """(family, level, seed) of each benchmark slot: every family at every level in turn."""
    fams, levels = cfg.benchmark_families, cfg.benchmark_levels
    return [(fams[i % len(fams)], levels[(i // len(fams)) % len(levels)], derive_seed(cfg.benchmark.seed, SPLIT, i))
            for i in range(cfg.benchmark.n)]


def generate_unique(slots: Iterable[tuple[str, int, int]], taken: set[str], what: str,
                    forbidden_tasks: Set[str] = frozenset()) -> list[ProblemSpec]:
    """One problem per (family, level, seed) slot whose content key is not in ``taken`` (updated)
    and whose normalised task text (:func:`apprentice.data.dedupe.task_key`) is not in ``forbidden_tasks``
    (the benchmark's, for training: the same first observation with another plan is still the
    benchmark's task to the model, and the data gate rejects it).

    A slot whose first seed collides tries seeds derived from it (deterministic, so the same config
    still gives the same problems). Raises ``ValueError`` when a level has too few distinct problems.
    """
    out = []
    for family, level, seed in slots:
        gen = resolve(family).generate
        for attempt in range(MAX_TRIES):
            spec = gen(seed if attempt == 0 else derive_seed(seed, "distinct", attempt), level)
            key = content_key(spec)
            if key not in taken and not (forbidden_tasks and spec_task_key(spec) in forbidden_tasks):
                taken.add(key)
                out.append(spec)
                break
        else:
            raise ValueError(
                f"{what}: {MAX_TRIES} seeds in a row gave {family} level-{level} problems whose task and oracle plan "
                f"repeat earlier ones (benchmark or training); this level has too few distinct problems for the "
                f"requested count: lower synth.n_train / benchmark.n, or add levels")
    return out


def content_keys(df: pd.DataFrame) -> set[str]:
    return {content_key(s) for s in specs_of(df)}


def task_keys(df: pd.DataFrame) -> set[str]:
    """Normalised task texts of a problems table (what synthesis keeps training away from)."""
    return {spec_task_key(s) for s in specs_of(df)}


def require(paths: Paths) -> pd.DataFrame:
    """The benchmark table; a clear error when it has not been synthesized yet."""
    if not paths.benchmark.exists():
        raise FileNotFoundError(f"no benchmark at {paths.benchmark}; run `python -m apprentice benchmark` first "
                                "(dvc repro does it)")
    return read_parquet(paths.benchmark)


def run(cfg: Config, paths: Paths, **_: Any) -> dict[str, Any]:
    from apprentice.envs.check import require_level_contract
    require_level_contract(cfg.benchmark_families, cfg.validate_.allow_non_monotone)
    slots = plan(cfg)
    specs = generate_unique(slots, set(), "benchmark")
    frame = problems_frame(specs, [lv for _, lv, _ in slots], "eval")  # the gates' held-out split
    write_parquet(frame, paths.benchmark)
    counts = {f: {str(lv): int(n) for lv, n in sorted(g.groupby("level").size().items())}
              for f, g in sorted(frame.groupby("family"))}
    summary = {"problems": len(frame), "counts": counts, "seed": cfg.benchmark.seed, "path": paths.rel(paths.benchmark)}
    with atomic_path(paths.benchmark_record) as tmp:
        tmp.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    return summary
