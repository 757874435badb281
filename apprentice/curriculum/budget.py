"""Which problems fit GRPO's episode budget: an episode cut off by the budget teaches nothing.

GRPO stops an episode after ``rl.max_completion_length`` tokens (tool responses included) or
``rl.max_tool_calls`` calls and scores what it reached, a failure. A problem whose shortest solution,
the oracle's, needs more than the budget can only give failing, clipped episodes: zero reward
variance when every sample is cut, and when some are not, an advantage that rewards finishing early
rather than acting well. DAPO (arXiv 2503.14476) masks such truncated samples out of the loss; we do
the cheaper thing first and do not sample problems that cannot fit, leaving them to SFT, whose
``sft.max_length`` is sized for them.

``slack``: the share of the token budget the oracle's solution may take. The policy's own episodes
run longer than the oracle's (a wrong move and its correction, a longer phrasing), so the oracle gets
less than the whole budget.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd

__all__ = ["Need", "SLACK", "budget_summary", "within_budget"]

SLACK = 0.75


@dataclass(frozen=True)
class Need:
    """What the oracle's episode of a problem takes: tool calls and completion tokens."""

    calls: int
    tokens: int


def within_budget(problems: pd.DataFrame, needs: Mapping[str, Need], max_tokens: int, max_calls: int) -> pd.DataFrame:
    """The rows of ``problems`` (order kept) whose oracle episode fits ``max_calls`` calls and
    ``SLACK`` x ``max_tokens`` tokens; a problem without a measured need is kept (nothing is known
    against it). When none fits, all are returned: RL on clipped episodes beats no RL, and the
    summary says so."""
    keep = [fits(needs.get(str(pid)), max_tokens, max_calls) for pid in problems["problem_id"]]
    if not any(keep):
        return problems
    return problems.loc[keep].reset_index(drop=True)


def fits(need: Need | None, max_tokens: int, max_calls: int) -> bool:
    return need is None or (need.calls <= max_calls and need.tokens <= SLACK * max_tokens)


def budget_summary(problems: pd.DataFrame, kept: pd.DataFrame, needs: Mapping[str, Need],
                   max_tokens: int, max_calls: int) -> dict[str, Any]:
    """What the budget filter did, per family and level (written to the RL stage's ``curriculum.json``)."""
    over = problems.loc[~problems["problem_id"].astype(str).isin(set(kept["problem_id"].astype(str)))]
    measured = [needs[str(p)] for p in problems["problem_id"] if str(p) in needs]
    return {
        "budget": {"max_completion_length": max_tokens, "max_tool_calls": max_calls, "slack": SLACK},
        "over_budget": len(over),
        "over_budget_by_level": {f"{f}/{lv}": int(n) for (f, lv), n in over.groupby(["family", "level"]).size().items()},
        "none_fit": len(problems) > 0 and not any(
            fits(needs.get(str(p)), max_tokens, max_calls) for p in problems["problem_id"]),
        "oracle_tokens_max": max((n.tokens for n in measured), default=0),
        "oracle_calls_max": max((n.calls for n in measured), default=0),
    }
