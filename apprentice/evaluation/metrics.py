"""Evaluation metrics over trajectory tables: success with a Wilson interval, unbiased pass@k,
per-difficulty breakdowns, efficiency counters, and the paired test used for promotion.

Why hand-written: each formula is a few lines (Wilson score interval; the unbiased pass@k of
"Evaluating Large Language Models Trained on Code", arXiv:2107.03374; exact McNemar via
``scipy.stats.binomtest``), and the libraries that bundle them (statsmodels,
evaluate, lm-eval) would each add a heavy dependency for one function. scipy does the only
non-trivial part, the exact binomial test.

``summarize`` returns a flat JSON-serialisable dict whose keys are valid DVC and MLflow metric
names (letters, digits, ``_``, ``/``): e.g. ``success_rate``, ``pass_at_1``, ``level_2/success_rate``.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd
from scipy.stats import binomtest

Z95 = 1.959963984540054  # two-sided 95 % normal quantile


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (good coverage at small n and p near 0 or 1)."""
    if n <= 0:
        return (0.0, 1.0)
    if not 0 <= successes <= n:
        raise ValueError(f"successes={successes} must lie in [0, n={n}]")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return (lo, hi)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c successes: 1 - C(n-c, k) / C(n, k) (arXiv:2107.03374),
    in the numerically stable product form 1 - prod_{i=n-c+1}^{n} (1 - k / i)."""
    if k < 1 or k > n:
        raise ValueError(f"pass@k needs 1 <= k <= n; got k={k}, n={n} (raise evaluate.samples_per_problem)")
    if not 0 <= c <= n:
        raise ValueError(f"c={c} must lie in [0, n={n}]")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mcnemar_exact(a: Sequence[bool], b: Sequence[bool]) -> dict[str, Any]:
    """Exact McNemar test on paired successes (same problems, same order).

    Only discordant pairs carry information: under H0 (no difference) ``a_only`` ~ Binomial(a_only +
    b_only, 1/2). Returns the two-sided p-value, the discordant counts and the direction
    (``"a"`` if a wins more discordant pairs, ``"b"``, or ``"tie"``).
    """
    a_arr, b_arr = np.asarray(a, dtype=bool), np.asarray(b, dtype=bool)
    if a_arr.shape != b_arr.shape:
        raise ValueError(f"paired test needs equal lengths, got {a_arr.size} and {b_arr.size}")
    a_only = int(np.sum(a_arr & ~b_arr))
    b_only = int(np.sum(~a_arr & b_arr))
    disc = a_only + b_only
    p = 1.0 if disc == 0 else float(binomtest(a_only, disc, 0.5, alternative="two-sided").pvalue)
    direction = "a" if a_only > b_only else "b" if b_only > a_only else "tie"
    return {"p_value": p, "a_only": a_only, "b_only": b_only, "n_pairs": int(a_arr.size),
            "both": int(np.sum(a_arr & b_arr)), "neither": int(np.sum(~a_arr & ~b_arr)),
            "direction": direction}


def paired_test(df_a: pd.DataFrame, df_b: pd.DataFrame) -> dict[str, Any]:
    """McNemar on episodes matched by (problem_id, sample_idx); unmatched episodes are ignored.

    Raises if the two tables share no episode (they were evaluated on different problem sets)."""
    key = ["problem_id", "sample_idx"]
    m = df_a[[*key, "success"]].merge(df_b[[*key, "success"]], on=key, suffixes=("_a", "_b"))
    if m.empty:
        raise ValueError("the two evaluations share no (problem_id, sample_idx); evaluate both on the same eval set")
    out = mcnemar_exact(m["success_a"].to_numpy(), m["success_b"].to_numpy())
    out["success_rate_a"] = float(m["success_a"].mean())
    out["success_rate_b"] = float(m["success_b"].mean())
    return out


def _rates(df: pd.DataFrame) -> dict[str, float]:
    n = len(df)
    s = int(df["success"].sum())
    lo, hi = wilson_interval(s, n)
    turns = int(df["turns"].sum())
    tool_calls = _tool_calls(df)
    return {
        "n": n,
        "success_rate": s / n if n else 0.0,
        "success_ci_low": lo,
        "success_ci_high": hi,
        "mean_reward": float(df["reward"].mean()) if n else 0.0,
        "mean_turns": float(df["turns"].mean()) if n else 0.0,
        "truncation_rate": float(df["truncated"].mean()) if n else 0.0,
        # per tool call actually executed; per assistant turn for malformed output
        "tool_error_rate": float(df["tool_errors"].sum()) / tool_calls if tool_calls else 0.0,
        "parse_error_rate": float(df["parse_errors"].sum()) / turns if turns else 0.0,
    }


def _tool_calls(df: pd.DataFrame) -> int:
    if "extra" not in df.columns:
        return int(df["turns"].sum())
    total = 0
    for e, t, p in zip(df["extra"], df["turns"], df["parse_errors"], strict=True):
        d = e if isinstance(e, dict) else (json.loads(e) if isinstance(e, str) and e else {})
        total += int(d.get("tool_calls", t - p))
    return total


def summarize(df: pd.DataFrame, pass_k: Iterable[int] = (1,)) -> dict[str, Any]:
    """Flat metrics of one evaluation (one row per episode, ``trajectories.TRAJECTORY_COLUMNS``)."""
    if df.empty:
        raise ValueError("no episodes to summarise; the evaluation produced an empty table")
    out: dict[str, Any] = {"n_episodes": len(df), "n_problems": int(df["problem_id"].nunique())}
    overall = _rates(df)
    overall.pop("n")
    out.update(overall)
    out["mean_prompt_tokens"] = float(df["prompt_tokens"].mean())
    out["mean_completion_tokens"] = float(df["completion_tokens"].mean())
    out["mean_tokens"] = out["mean_prompt_tokens"] + out["mean_completion_tokens"]
    out["total_completion_tokens"] = int(df["completion_tokens"].sum())
    out["mean_wall_s"] = float(df["wall_s"].mean())

    per = df.groupby("problem_id")["success"].agg(["size", "sum"])
    n_min = int(per["size"].min())
    for k in sorted(set(pass_k)):
        if k > n_min:
            continue  # not estimable: fewer samples than k for some problem
        out[f"pass_at_{k}"] = float(np.mean([pass_at_k(int(n), int(c), k) for n, c in zip(per["size"], per["sum"], strict=True)]))

    for col, prefix in (("level", "level"), ("family", "family")):
        for val, g in sorted(df.groupby(col), key=lambda kv: str(kv[0])):
            r = _rates(g)
            for name in ("n", "success_rate", "success_ci_low", "success_ci_high", "mean_turns", "truncation_rate",
                         "tool_error_rate", "parse_error_rate"):
                out[f"{prefix}_{val}/{name}"] = r[name]
    if "policy_id" in df.columns and df["policy_id"].nunique() == 1:
        out["policy_id"] = str(df["policy_id"].iloc[0])
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in out.items()}


def format_table(metrics: dict[str, Any], title: str = "evaluation") -> str:
    """A readable terminal table: headline numbers, then one row per level and per family."""
    from rich.console import Console
    from rich.table import Table

    def pct(x: float) -> str:
        return f"{100 * x:5.1f}%"

    head = Table(title=title, show_header=False, box=None, pad_edge=False)
    head.add_column(justify="left")
    head.add_column(justify="right")
    head.add_row("policy", str(metrics.get("policy_id", "?")))
    head.add_row("episodes / problems", f"{metrics['n_episodes']} / {metrics['n_problems']}")
    head.add_row("success (95% Wilson CI)",
                 f"{pct(metrics['success_rate'])}  [{pct(metrics['success_ci_low'])}, {pct(metrics['success_ci_high'])}]")
    for k in sorted(int(key.split("_")[-1]) for key in metrics if key.startswith("pass_at_")):
        head.add_row(f"pass@{k}", pct(metrics[f"pass_at_{k}"]))
    head.add_row("mean turns", f"{metrics['mean_turns']:.2f}")
    head.add_row("mean tokens (prompt + completion)",
                 f"{metrics['mean_prompt_tokens']:.0f} + {metrics['mean_completion_tokens']:.0f}")
    head.add_row("truncated", pct(metrics["truncation_rate"]))
    head.add_row("tool-error rate (per call)", pct(metrics["tool_error_rate"]))
    head.add_row("parse-error rate (per turn)", pct(metrics["parse_error_rate"]))

    groups = Table(show_lines=False)
    for col, j in (("group", "left"), ("n", "right"), ("success", "right"), ("95% CI", "right"),
                   ("turns", "right"), ("trunc", "right"), ("tool err", "right"), ("parse err", "right")):
        groups.add_column(col, justify=j)  # type: ignore[arg-type]
    names = sorted({k.split("/")[0] for k in metrics if "/" in k}, key=lambda s: (not s.startswith("level_"), s))
    for g in names:
        m = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith(g + "/")}
        groups.add_row(g.replace("_", " ", 1), str(m["n"]), pct(m["success_rate"]),
                       f"[{pct(m['success_ci_low'])}, {pct(m['success_ci_high'])}]", f"{m['mean_turns']:.2f}",
                       pct(m["truncation_rate"]), pct(m["tool_error_rate"]), pct(m["parse_error_rate"]))

    buf = io.StringIO()
    console = Console(file=buf, width=110, force_terminal=False, color_system=None)
    console.print(head)
    if names:
        console.print(groups)
    return buf.getvalue()


def success_ratio(df_a: pd.DataFrame, df_b: pd.DataFrame, n_resamples: int = 10_000, seed: int = 0,
                  level: float = 0.95) -> dict[str, Any]:
    """Success rate of A over B's on the same episodes, with a paired bootstrap interval over problems.

    Why a bootstrap and not Newcombe: the target is a *ratio* ("the student reaches >= 0.7x its
    teacher"), and Newcombe's interval is for a difference. Problems are resampled as pairs
    (``scipy.stats.bootstrap(paired=True)``, percentile method, which stays defined when a resample
    has a zero denominator: those resamples are dropped as NaN by the percentile).
    """
    from scipy import stats

    key = ["problem_id", "sample_idx"]
    m = df_a[[*key, "success"]].merge(df_b[[*key, "success"]], on=key, suffixes=("_a", "_b"))
    if m.empty:
        raise ValueError("the two evaluations share no (problem_id, sample_idx); evaluate both on the same benchmark")
    a, b = m["success_a"].to_numpy(float), m["success_b"].to_numpy(float)
    ratio = float(a.mean() / b.mean()) if b.mean() else float("nan")

    def stat(x: Any, y: Any, axis: int = -1) -> Any:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.mean(x, axis=axis) / np.mean(y, axis=axis)

    lo = hi = float("nan")
    if b.sum() > 0:
        res = stats.bootstrap((a, b), stat, paired=True, vectorized=True, n_resamples=n_resamples,
                              confidence_level=level, method="percentile", random_state=seed)
        lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return {"ratio": ratio, "ci_low": lo, "ci_high": hi, "n_pairs": int(len(m)), "success_a": float(a.mean()),
            "success_b": float(b.mean()), "method": f"paired bootstrap over problems, {n_resamples} resamples, "
                                                    f"percentile {int(level * 100)} %"}


def action_diversity(df: pd.DataFrame) -> dict[str, float]:
    """A cheap policy-entropy proxy from episodes alone (no model pass): over every assistant turn of
    ``df``, the Shannon entropy (nats) of the empirical distribution of actions (tool name + arguments,
    or the raw text of a turn without a call) and the share of distinct actions. A loop that collapses
    (capability that shrinks over rounds of training on its own output, or drift driven by its own
    feedback) shows as both falling across iterations while the problems stay the same (the fixed
    benchmark)."""
    from collections import Counter

    counts: Counter[str] = Counter()
    for raw in df["messages"]:
        for m in json.loads(raw) if isinstance(raw, str) else raw:
            if m.get("role") != "assistant":
                continue
            calls = m.get("tool_calls") or []
            key = json.dumps([c.get("function", c) for c in calls], sort_keys=True) if calls else str(m.get("content"))
            counts[key] += 1
    n = sum(counts.values())
    if not n:
        return {"action_entropy": 0.0, "distinct_action_ratio": 0.0, "n_actions": 0.0}
    ent = -sum(c / n * np.log(c / n) for c in counts.values())
    return {"action_entropy": round(float(ent), 6) + 0.0, "distinct_action_ratio": round(len(counts) / n, 6),
            "n_actions": float(n)}
