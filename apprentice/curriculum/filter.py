"""Curriculum for RL: order problems easy -> hard, drop problems that carry no GRPO signal.

Pure functions over tables so they are unit-testable without a model:
  * :func:`order_by_difficulty`: sort by (level, sum of the difficulty vector, problem_id). The
    problem_id tie-break makes the order identical across runs and machines.
  * :func:`pass_rate_filter`: GRPO's advantage is reward minus the group mean, so a problem the
    policy always solves (pass rate 1) or never solves (pass rate 0) gives every sample the same
    reward and a zero gradient (METHODS.md §4 "pass-rate calibration", §2 DTAC). Dropping them spends
    the few RL steps we can afford where they can move the policy.
  * :func:`pass_rates`: the table the filter reads, from probe trajectories.
  * :func:`feed_generations`: which evolved generation joins the RL pool: the generation scheduler
    (``envs.evolve.GenerationScheduler``) walks generations 0, 1, ... while the policy's probed pass
    rate on the current one reaches the advance threshold, so training meets the first generation
    the policy has not mastered (METHODS.md §1: evolve the environment as the learner improves).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd


def difficulty_key(row: Mapping[str, Any]) -> tuple[int, int, str]:
    diff = row["difficulty"]
    if isinstance(diff, str):
        diff = json.loads(diff)
    return int(row.get("level", 0)), int(sum(int(v) for v in dict(diff).values())), str(row["problem_id"])


def order_by_difficulty(problems: pd.DataFrame) -> pd.DataFrame:
    """Problems sorted easy -> hard (level, then difficulty-vector sum, then id); index reset."""
    if problems.empty:
        return problems.reset_index(drop=True)
    keys = [difficulty_key(r) for r in problems.to_dict("records")]
    order = sorted(range(len(keys)), key=keys.__getitem__)
    return problems.iloc[order].reset_index(drop=True)


@dataclass(frozen=True)
class PassRate:
    successes: int
    samples: int

    @property
    def rate(self) -> float:
        return self.successes / self.samples if self.samples else float("nan")


def pass_rates(problem_ids: Iterable[str], successes: Iterable[bool]) -> dict[str, PassRate]:
    """Aggregate per-episode outcomes (one entry per probe episode) into a per-problem table."""
    counts: dict[str, list[int]] = {}
    for pid, ok in zip(problem_ids, successes, strict=True):
        c = counts.setdefault(str(pid), [0, 0])
        c[0] += int(bool(ok))
        c[1] += 1
    return {pid: PassRate(s, n) for pid, (s, n) in counts.items()}


def informative(rate: PassRate) -> bool:
    """A problem carries GRPO signal iff the probe saw both a success and a failure."""
    return 0 < rate.successes < rate.samples


def pass_rate_filter(ordered_ids: list[str], table: Mapping[str, PassRate]) -> list[str]:
    """Keep the problems of ``ordered_ids`` (curriculum order preserved) that are worth training on.

    * probed with 0 < pass rate < 1: kept;
    * probed with pass rate 0 or 1: dropped (no within-group reward variance);
    * not probed (beyond the probe budget): kept, since nothing is known against them.

    If every problem was probed and none is informative, the filter would leave nothing to train
    on; it then falls back to the unfiltered order with a warning (training on a constant-reward
    group is a no-op, not an error).
    """
    kept = [pid for pid in ordered_ids if pid not in table or informative(table[pid])]
    if not kept and ordered_ids:
        warnings.warn(
            "pass-rate filter: every probed problem was always or never solved by the current policy; "
            "training on the unfiltered curriculum (expect ~zero GRPO gradient). Probe more problems "
            "(rl.probe_problems) or add harder/easier levels (synth.levels).",
            stacklevel=2,
        )
        return list(ordered_ids)
    return kept


def band_first(kept: list[str], table: Mapping[str, PassRate],
               strata: Mapping[str, Any] | None = None) -> list[str]:
    """``kept`` with the probed, informative problems first, then the unprobed ones whose stratum
    (e.g. (family, level)) the probe found closest to a 0.5 pass rate; curriculum order within ties.

    GRPO reads the dataset in order and takes only ``max_steps x prompts_per_step`` prompts on CPU;
    unprobed problems interleaved by difficulty would otherwise come first and, being mostly easy,
    give constant-reward groups (zero gradient). A probe sees a few problems per stratum; their
    pooled pass rate is the best cheap guess of where an unprobed problem's group will vary."""
    band = [p for p in kept if p in table and informative(table[p])]
    rest = [p for p in kept if p not in set(band)]
    if strata:
        pooled: dict[Any, list[int]] = {}
        for pid, r in table.items():
            if pid in strata:
                c = pooled.setdefault(strata[pid], [0, 0])
                c[0], c[1] = c[0] + r.successes, c[1] + r.samples
        def distance(pid: str) -> float:
            c = pooled.get(strata.get(pid))
            return abs(c[0] / c[1] - 0.5) if c and c[1] and pid not in table else 1.0
        rest = sorted(rest, key=distance)  # stable: curriculum order within equal distances
    return band + rest


def filter_summary(ordered_ids: list[str], table: Mapping[str, PassRate], kept: list[str]) -> dict[str, Any]:
    probed = [pid for pid in ordered_ids if pid in table]
    return {
        "candidates": len(ordered_ids),
        "probed": len(probed),
        "always_solved": sum(1 for p in probed if table[p].samples and table[p].successes == table[p].samples),
        "never_solved": sum(1 for p in probed if table[p].successes == 0),
        "kept": len(kept),
        "mean_probe_pass_rate": (sum(table[p].rate for p in probed) / len(probed)) if probed else None,
    }


def feed_generations(generations: Sequence[pd.DataFrame], n: int, threshold: float,
                     probe: Callable[[pd.DataFrame], Mapping[str, PassRate]]
                     ) -> tuple[pd.DataFrame, dict[str, PassRate], dict[str, Any]]:
    """Walk evolved generations with a :class:`GenerationScheduler`; return the one to train on.

    ``probe(rows)`` runs the current policy on ``rows`` (the first ``n`` problems of a generation)
    and returns their pass rates. Each probed generation is observed once; the walk stops at the
    first generation whose pass rate is below ``threshold`` (or at the last one). Returns that
    generation's probed rows, their pass rates (reused by the RL filter/sampler: no second probe)
    and the scheduler's state (generation chosen, pass rate per generation seen)."""
    from apprentice.envs.evolve import GenerationScheduler

    if not generations:
        raise ValueError("no evolved generations to feed; run the evolve stage (python -m apprentice evolve)")
    sched = GenerationScheduler(len(generations), threshold)
    while True:
        g = sched.current
        rows = generations[g].head(n).reset_index(drop=True)
        rates = dict(probe(rows))
        hits, total = sum(r.successes for r in rates.values()), sum(r.samples for r in rates.values())
        if sched.observe(hits / total if total else 0.0) == g:
            return rows, rates, {**sched.state_dict(), "generation": g}
