"""The pass-rate table: the one shape in which every curriculum decision reads how the policy does.

A stage measures (RL probe rollouts) or predicts (synthesis: the ex-ante difficulty predictor) a pass
rate per problem and hands the curriculum a ``{problem_id: PassRate(successes, samples)}`` mapping,
:data:`PassRates`. The pass-rate filter reads it as is; the samplers need the problems' evolution
directions and abilities next to the rates, so :func:`table_from_rates` widens it to a pandas frame
(built here and only here, inside the package: no stage builds it itself).

:func:`pass_table` builds the same frame straight from trajectory rows (offline analysis and tests).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import pandas as pd

__all__ = ["PassRate", "PassRates", "pass_rates", "pass_table", "table_from_rates"]


@dataclass(frozen=True)
class PassRate:
    successes: int
    samples: int

    @property
    def rate(self) -> float:
        return self.successes / self.samples if self.samples else float("nan")


#: What every curriculum entry point takes: per-problem successes out of samples (probed or predicted).
PassRates = Mapping[str, PassRate]


def pass_rates(problem_ids: Iterable[str], successes: Iterable[bool]) -> dict[str, PassRate]:
    """Aggregate per-episode outcomes (one entry per probe episode) into a per-problem table."""
    counts: dict[str, list[int]] = {}
    for pid, ok in zip(problem_ids, successes, strict=True):
        c = counts.setdefault(str(pid), [0, 0])
        c[0] += int(bool(ok))
        c[1] += 1
    return {pid: PassRate(s, n) for pid, (s, n) in counts.items()}


def table_from_rates(rates: PassRates, problems: pd.DataFrame) -> pd.DataFrame:
    """The samplers' frame from :data:`PassRates` plus the problems frame that holds their specs
    (problems without a rate are left out)."""
    ids = [pid for pid in problems["problem_id"] if pid in rates]
    spec = problems.set_index("problem_id").loc[ids, "spec"]
    rows = pd.DataFrame({"problem_id": ids, "success": [0] * len(ids), "spec": list(spec)})
    t = pass_table(rows)
    t["attempts"] = [int(rates[i].samples) for i in t["problem_id"]]
    t["successes"] = [int(rates[i].successes) for i in t["problem_id"]]
    t["pass_rate"] = t["successes"] / t["attempts"].where(t["attempts"] > 0)
    return t


def pass_table(trajectories: pd.DataFrame, problems: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per-problem table from trajectory rows (``problem_id``, ``success``, ``spec``), with the
    direction scores and abilities the samplers read. ``problems`` (a problems parquet frame) adds
    unprobed problems with attempts 0 and pass rate NaN."""
    from apprentice.envs import ProblemSpec
    from apprentice.envs.evolve import abilities_of, direction_scores

    agg = trajectories.groupby("problem_id").agg(attempts=("success", "size"), successes=("success", "sum"),
                                                 spec=("spec", "first")).reset_index()
    if problems is not None:
        missing = problems[~problems["problem_id"].isin(agg["problem_id"])]
        agg = pd.concat([agg, pd.DataFrame({"problem_id": missing["problem_id"], "attempts": 0, "successes": 0,
                                            "spec": missing["spec"]})], ignore_index=True)
    agg["pass_rate"] = agg["successes"] / agg["attempts"].where(agg["attempts"] > 0)
    specs = [ProblemSpec.from_json(s) for s in agg["spec"]]
    scores = pd.DataFrame([direction_scores(s) for s in specs])
    agg = pd.concat([agg.reset_index(drop=True), scores], axis=1)
    agg["family"] = [s.family for s in specs]
    agg["abilities"] = [sorted(abilities_of(s)) for s in specs]
    return agg
