"""The RL budget filter: problems whose oracle episode cannot fit GRPO's budget are left out."""

import pandas as pd

from apprentice.curriculum import Need, budget, within_budget


def table(*rows: tuple[str, str, int]) -> pd.DataFrame:
    return pd.DataFrame([{"problem_id": p, "family": f, "level": lv} for p, f, lv in rows])


def test_fits_counts_calls_and_a_share_of_the_tokens():
    assert budget.fits(Need(calls=8, tokens=480), max_tokens=640, max_calls=8)
    assert not budget.fits(Need(calls=9, tokens=100), max_tokens=640, max_calls=8)
    assert not budget.fits(Need(calls=3, tokens=481), max_tokens=640, max_calls=8)  # > 3/4 of 640
    assert budget.fits(None, max_tokens=16, max_calls=1)  # nothing known: kept


def test_within_budget_keeps_order_and_unmeasured_rows():
    probs = table(("a", "grid", 4), ("b", "grid", 0), ("c", "search", 2), ("d", "grid", 1))
    needs = {"a": Need(11, 800), "b": Need(2, 150), "d": Need(3, 200)}
    kept = within_budget(probs, needs, max_tokens=640, max_calls=8)
    assert kept["problem_id"].tolist() == ["b", "c", "d"]
    s = budget.budget_summary(probs, kept, needs, 640, 8)
    assert s["over_budget"] == 1 and s["over_budget_by_level"] == {"grid/4": 1}
    assert s["oracle_calls_max"] == 11 and not s["none_fit"]


def test_when_nothing_fits_all_are_kept_and_the_summary_says_so():
    probs = table(("a", "grid", 6), ("b", "grid", 7))
    needs = {"a": Need(20, 1500), "b": Need(25, 1800)}
    kept = within_budget(probs, needs, max_tokens=640, max_calls=8)
    assert len(kept) == 2
    s = budget.budget_summary(probs, kept, needs, 640, 8)
    assert s["none_fit"] and s["over_budget"] == 0
