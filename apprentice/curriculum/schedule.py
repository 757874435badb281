"""Which evolved generation joins the RL pool: the generation scheduler.

Environment evolution hardens environments off-policy and feeds the generations to RL one at a
time, so the environment keeps pace with the learner. The evolve stage
(:mod:`apprentice.envs.evolve`, the off-policy operators that make generation g+1 harder than g)
writes generations 0..G; :class:`GenerationScheduler` walks them 0, 1, ... while the policy's probed
pass rate on the current one reaches ``curriculum.advance_threshold``, so training meets the first
generation the policy has not mastered. :func:`feed_generations` is the entry point (the RL stage and
``experiments/evolve_feed.py`` call it); the operators stay with the environments, the choice is curriculum.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pandas as pd

from apprentice.curriculum.table import PassRate, PassRates

__all__ = ["GenerationScheduler", "feed_generations"]


class GenerationScheduler:
    """Which generation training draws from: advance when the student's pass rate on the current
    generation reaches ``threshold`` (never past the last; never back)."""

    def __init__(self, n_generations: int, threshold: float) -> None:
        if n_generations < 1:
            raise ValueError("n_generations must be >= 1")
        self.n, self.threshold, self.current = n_generations, threshold, 0
        self.history: list[tuple[int, float]] = []

    def observe(self, pass_rate: float) -> int:
        """Record the student's pass rate on the current generation; return the generation to use next."""
        self.history.append((self.current, float(pass_rate)))
        if pass_rate >= self.threshold and self.current < self.n - 1:
            self.current += 1
        return self.current

    def state_dict(self) -> dict[str, Any]:
        return {"current": self.current, "threshold": self.threshold, "n": self.n, "history": self.history}

    @classmethod
    def from_state(cls, d: Mapping[str, Any]) -> GenerationScheduler:
        s = cls(int(d["n"]), float(d["threshold"]))
        s.current = int(d["current"])
        s.history = [(int(g), float(p)) for g, p in d.get("history", [])]
        return s


def feed_generations(generations: Sequence[pd.DataFrame], n: int, threshold: float,
                     probe: Callable[[pd.DataFrame], PassRates]
                     ) -> tuple[pd.DataFrame, dict[str, PassRate], dict[str, Any]]:
    """Walk evolved generations with a :class:`GenerationScheduler`; return the one to train on.

    ``probe(rows)`` runs the current policy on ``rows`` (the first ``n`` problems of a generation)
    and returns their pass rates. Each probed generation is observed once; the walk stops at the
    first generation whose pass rate is below ``threshold`` (or at the last one). Returns that
    generation's probed rows, their pass rates (reused by the RL filter/sampler: no second probe)
    and the scheduler's state (generation chosen, pass rate per generation seen)."""
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
