"""In what order the RL stage reads its problems, and which of them the probe measures.

* :func:`order_by_difficulty`: sort by (level, sum of the difficulty vector, problem_id). The
  problem_id tie-break makes the order identical across runs and machines. GRPO reads the dataset in
  order, so this is the easy -> hard curriculum (``rl.curriculum: difficulty``); ``random`` and
  ``sampler`` start from a seeded shuffle instead.
* :func:`spread`: the probe (sampled rollouts of the current policy, the source of the
  :data:`~apprentice.curriculum.table.PassRates` the filter and samplers read) covers rows evenly
  spaced over that order, not its head.

:func:`probe_plan` is the entry point: both, from the config.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pandas as pd

__all__ = ["difficulty_key", "order_by_difficulty", "probe_plan", "spread"]


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


def spread(ordered: pd.DataFrame, n: int) -> pd.DataFrame:
    """``n`` rows evenly spaced over the curriculum order (easy -> hard), in that order.

    Why not the first ``n``: the easiest problems are the ones an SFT model already always solves
    (no GRPO signal); probing across the whole order finds the band where it sometimes succeeds."""
    if n >= len(ordered):
        return ordered
    idx = sorted({round(i * (len(ordered) - 1) / max(n - 1, 1)) for i in range(n)})
    return ordered.iloc[idx].reset_index(drop=True)


def probe_plan(problems: pd.DataFrame, cfg: Any, feed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """The RL stage's training problems in curriculum order, and the rows its probe covers (``None``
    when ``rl.probe_samples`` is 0: nothing is probed and every problem is kept, in order).

    ``cfg`` is the whole :class:`apprentice.config.Config` (``rl.curriculum``, ``rl.seed``,
    ``rl.probe_problems``, ``rl.probe_samples``); ``feed`` the evolved problems the generation
    scheduler will feed in (``curriculum.evolve.feed`` when generations exist), which needs the probe."""
    if "split" in problems.columns:
        problems = problems[problems["split"] != "eval"]
    ordered = order_by_difficulty(problems) if cfg.rl.curriculum == "difficulty" else \
        problems.sample(frac=1.0, random_state=cfg.rl.seed).reset_index(drop=True)
    if cfg.rl.probe_samples <= 0:
        if feed:
            raise ValueError("curriculum.evolve.feed > 0 needs the RL probe to measure the policy on each "
                             "generation; set rl.probe_samples >= 1 or curriculum.evolve.feed: 0")
        return ordered, None
    return ordered, spread(ordered, cfg.rl.probe_problems)
