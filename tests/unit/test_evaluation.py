"""Metrics against hand-computed values."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from apprentice.evaluation.metrics import (
    format_table,
    mcnemar_exact,
    paired_test,
    pass_at_k,
    summarize,
    wilson_interval,
)


def test_wilson_7_of_10():
    # p=0.7, z=1.96: centre=(0.7+0.19207)/1.38415=0.64449, half=1.96*sqrt(0.021+0.00096)/1.38415=0.20984
    lo, hi = wilson_interval(7, 10)
    assert lo == pytest.approx(0.39676, abs=1e-4) and hi == pytest.approx(0.89222, abs=1e-4)


def test_wilson_edges():
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0
    assert wilson_interval(10, 10)[0] == pytest.approx(0.72247, abs=1e-4)  # z^2/(n+z^2) bound
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(11, 10)


@pytest.mark.parametrize("k,expected", [(1, 1 - 3 / 5), (2, 1 - 3 / 10), (3, 1 - 1 / 10), (4, 1.0), (5, 1.0)])
def test_pass_at_k_n5_c2(k, expected):
    # 1 - C(3,k)/C(5,k): C(3,1)/C(5,1)=3/5, C(3,2)/C(5,2)=3/10, C(3,3)/C(5,3)=1/10, C(3,4)=0
    assert pass_at_k(5, 2, k) == pytest.approx(expected)
    assert pass_at_k(5, 2, k) == pytest.approx(1 - math.comb(3, k) / math.comb(5, k))


def test_pass_at_k_bounds():
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(1, 1, 1) == 1.0
    assert pass_at_k(200, 3, 100) == pytest.approx(1 - math.comb(197, 100) / math.comb(200, 100))
    with pytest.raises(ValueError, match="samples_per_problem"):
        pass_at_k(2, 1, 3)


def test_mcnemar_exact_known_table():
    # discordant pairs: a only 1, b only 9 -> p = 2 * P(X <= 1 | n=10, 1/2) = 2 * 11 / 1024
    a = [True] * 5 + [True] + [False] * 9 + [False] * 5
    b = [True] * 5 + [False] + [True] * 9 + [False] * 5
    r = mcnemar_exact(a, b)
    assert r["p_value"] == pytest.approx(22 / 1024)
    assert (r["a_only"], r["b_only"], r["both"], r["neither"], r["direction"]) == (1, 9, 5, 5, "b")
    assert mcnemar_exact([True, False], [True, False]) | {"n_pairs": 2} == mcnemar_exact([True, False], [True, False])
    assert mcnemar_exact([True, False], [True, False])["p_value"] == 1.0
    assert mcnemar_exact([True, False], [True, False])["direction"] == "tie"


def _frame(successes, levels, families, problems=None, samples=None):
    n = len(successes)
    return pd.DataFrame({
        "problem_id": problems or [f"p{i}" for i in range(n)],
        "sample_idx": samples or [0] * n,
        "family": families, "level": levels, "policy_id": ["pol"] * n,
        "success": successes, "reward": [float(s) for s in successes],
        "turns": [3] * n, "truncated": [not s for s in successes],
        "tool_errors": [1] * n, "parse_errors": [0] * n,
        "prompt_tokens": [100] * n, "completion_tokens": [20] * n, "wall_s": [1.0] * n,
        "extra": [json.dumps({"tool_calls": 2})] * n,
    })


def test_summarize_breakdowns_and_json():
    df = _frame([True] * 7 + [False] * 3, [0] * 5 + [1] * 5, ["grid", "search"] * 5)
    m = summarize(df)
    json.dumps(m)  # JSON-serialisable
    assert m["n_episodes"] == 10 and m["success_rate"] == 0.7
    assert m["success_ci_low"] == pytest.approx(0.39676, abs=1e-4)
    assert m["pass_at_1"] == pytest.approx(0.7)
    assert m["level_0/success_rate"] == 1.0 and m["level_1/success_rate"] == pytest.approx(0.4)
    assert m["family_grid/n"] == 5 and m["family_search/success_rate"] == pytest.approx(0.6)
    assert m["tool_error_rate"] == 0.5 and m["parse_error_rate"] == 0.0  # 1 error per 2 calls
    assert m["mean_tokens"] == 120 and m["mean_turns"] == 3 and m["truncation_rate"] == pytest.approx(0.3)
    assert all(set(k) <= set("abcdefghijklmnopqrstuvwxyz0123456789_/") for k in m)


def test_summarize_pass_at_k_over_samples():
    # two problems x 5 samples: c=2 and c=5
    df = _frame([True, True, False, False, False] + [True] * 5, [0] * 10, ["grid"] * 10,
                problems=["a"] * 5 + ["b"] * 5, samples=list(range(5)) * 2)
    m = summarize(df, pass_k=[1, 2, 5, 8])
    assert m["pass_at_1"] == pytest.approx((0.4 + 1) / 2)
    assert m["pass_at_2"] == pytest.approx((0.7 + 1) / 2)
    assert m["pass_at_5"] == 1.0 and "pass_at_8" not in m


def test_paired_test_matches_episodes():
    a = _frame([True, True, False, True], [0] * 4, ["grid"] * 4)
    b = _frame([False, False, False, True], [0] * 4, ["grid"] * 4).iloc[::-1]  # order must not matter
    r = paired_test(a, b)
    assert (r["a_only"], r["b_only"], r["direction"]) == (2, 0, "a")
    assert r["p_value"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="same eval set"):
        paired_test(a, b.assign(problem_id=["x"] * 4))


def test_format_table_is_readable():
    text = format_table(summarize(_frame([True, False], [0, 1], ["grid", "search"])))
    assert "success" in text and "50.0%" in text and "level 0" in text and "family search" in text


def test_success_ratio_paired_bootstrap():
    import pandas as pd

    from apprentice.evaluation.metrics import success_ratio

    ids = [f"p{i}" for i in range(40)]
    teacher = pd.DataFrame({"problem_id": ids, "sample_idx": 0, "success": [i < 20 for i in range(40)]})
    student = pd.DataFrame({"problem_id": ids, "sample_idx": 0, "success": [i < 16 for i in range(40)]})
    r = success_ratio(student, teacher, n_resamples=2000)
    assert r["ratio"] == 0.8 and r["n_pairs"] == 40
    assert r["ci_low"] <= 0.8 <= r["ci_high"] and r["ci_high"] <= 1.0  # the student never beats it on a pair
    same = success_ratio(teacher, teacher, n_resamples=500)
    assert same["ci_low"] == same["ci_high"] == 1.0
