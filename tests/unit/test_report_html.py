"""The iteration report page (apprentice/ops/report_html.py): content from real stage-output formats,
robust to missing inputs, self-contained (no scripts, no external resources)."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import yaml

from apprentice.evaluation.metrics import summarize
from apprentice.ops import report_html
from apprentice.paths import Paths


def _episodes(rate: float, n: int = 20, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({
        "problem_id": [f"p{i}" for i in range(n)], "success": rng.random(n) < rate,
        "turns": rng.integers(1, 5, n), "reward": rng.random(n), "truncated": [False] * n,
        "tool_errors": [0] * n, "parse_errors": [0] * n, "prompt_tokens": [100] * n,
        "completion_tokens": [20] * n, "wall_s": [0.1] * n, "level": [i % 2 for i in range(n)],
        "family": ["grid" if i % 3 else "search" for i in range(n)]})


def _iteration(root, k: int, promoted: bool, p_value: float | None) -> Paths:
    paths = Paths(root, k)
    paths.eval_dir.mkdir(parents=True)
    for policy, rate in (("base", 0.0), ("sft", 0.5), ("rl", 0.6)):
        (paths.eval_dir / f"{policy}.json").write_text(json.dumps(summarize(_episodes(rate, seed=k), [1])))
    for folder in ("sft", "rl"):
        (paths.models / folder).mkdir(parents=True)
        (paths.models / folder / "metrics.jsonl").write_text("".join(
            json.dumps({"stage": folder, "step": s, "loss": 2.0 / s, "learning_rate": 1e-4 * s, "reward": 0.1 * s})
            + "\n" for s in range(1, 5)) + "not json\n")
    paths.reports.mkdir(parents=True)
    (paths.reports / "gate.json").write_text(json.dumps({"passed": True, "expectations": 3, "failed": 0, "suites": {
        "trajectories:teacher": {"suite": "trajectories", "table": "teacher", "rows": 12, "success": True,
                                 "checks": [{"expectation": "expect_column_values_to_not_be_null",
                                             "kwargs": {"column": "messages"}, "success": True}]}}}))
    (paths.reports / "promotion.json").write_text(json.dumps({
        "registered_model": "apprentice-agent", "version": k, "candidate": "rl", "promoted": promoted,
        "reason": "challenger wins the paired test" if promoted else "not significant; champion kept",
        "champion_version": k if promoted else 1, "champion_before": k - 1, "challenger_success": 0.6,
        "champion_success": 0.4 if p_value is not None else None, "p_value": p_value, "n_pairs": 20,
        "challenger_only": 5, "champion_only": 1, "weights_path": f"models/iter_{k}/rl", "dvc_md5": "abc123",
        "tested": {"rl": {"p_value": p_value, "challenger_success": 0.6, "challenger_only": 5, "champion_only": 1},
                   "sft": {"p_value": 0.0312, "challenger_success": 0.55, "challenger_only": 6, "champion_only": 0}}}))
    return paths


def test_report_shows_every_section_from_stage_outputs(tmp_path):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"pipeline": {"profile": "quick"},
                                                          "promote": {"alpha": 0.05}}))
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": {
        "sft-2": {"deps": [{"path": "data/iter_2/sft.parquet", "md5": "d41d8cd9"},
                           {"path": "../../apprentice/stages/sft.py", "md5": "code"}],
                  "outs": [{"path": "models/iter_2/sft", "md5": "feedbeef.dir"}]},
        "sft-1": {"outs": [{"path": "models/iter_1/sft", "md5": "other.dir"}]}}}))
    _iteration(tmp_path, 1, promoted=True, p_value=None)
    paths = _iteration(tmp_path, 2, promoted=False, p_value=0.21)
    runs = {"tracking_uri": "sqlite:///x.db", "experiment_id": "1", "parent": {"run_id": "p" * 32, "name": "iter-2"},
            "stages": {"sft-2": "s" * 32}}

    page = report_html.write(paths, runs, "0123456789abcdef").read_text()

    for heading in ("Learning table", "Per level and per family", "Learning curves", "Data gate", "Promotion",
                    "Champion across iterations", "Lineage"):
        assert f">{heading}</h2>" in page
    sft = json.loads((paths.eval_dir / "sft.json").read_text())
    assert f"{100 * sft['success_rate']:.1f}%" in page  # the learning table with its Wilson interval
    assert f"[{100 * sft['success_ci_low']:.1f}, {100 * sft['success_ci_high']:.1f}]" in page
    assert ">grid</b>" in page and ">search</b>" in page and "per difficulty level" in page
    assert page.count("<svg") >= 4  # success chart, sft + rl curves, champion trend
    assert "No distill training log yet" in page  # the missing stage says how to produce it
    assert "kept as challenger" in page and "0.21" in page and "exact McNemar" in page
    assert "models tested (each at alpha / 2)" in page and "sft: 55.0%, 6 / 0, p = 0.0312" in page
    assert "iteration 1" in page and "iteration 2" in page  # the trend covers every promotion so far
    assert "feedbeef.dir" in page and "other.dir" not in page and ">code<" not in page  # this iteration, data only
    assert "s" * 32 in page and "0123456789abcdef" in page
    # self-contained: no script, no stylesheet or image fetched from anywhere
    assert "<script" not in page
    assert not re.search(r'<(link|img|iframe)\b', page)
    assert not re.search(r'(src|href)="(https?:)?//', page.replace('href="http://127.0.0.1:5000', ""))


def test_report_of_an_empty_iteration_says_what_is_missing(tmp_path):
    page = report_html.render(report_html.collect(Paths(tmp_path, 3)))
    assert "No evaluation results yet" in page and "No data-gate result yet" in page
    assert "No promotion decision yet" in page and "No MLflow run ids" in page
    assert "<svg" not in page


def test_frontier_section_shows_the_champion_per_level_across_iterations_and_the_decisions(tmp_path):
    """The heatmap reads each promotion's champion's benchmark episodes per family x level (the
    champion kept in iteration 2 is iteration 1's model, so its column repeats), and the decision table
    each iteration's frontier.json."""
    from apprentice.data.trajectories import write_parquet

    for k, rate in ((1, 0.2), (2, 0.9)):
        paths = Paths(tmp_path, k)
        paths.eval_dir.mkdir(parents=True)
        eps = _episodes(rate, n=40, seed=k)
        write_parquet(eps, paths.eval_episodes("rl"))
        paths.reports.mkdir(parents=True)
        champ = {"kind": "rl", "iteration": 1, "version": 1}
        (paths.reports / "promotion.json").write_text(json.dumps({"champion": champ, "promoted": k == 1}))
        (paths.reports / "frontier.json").write_text(json.dumps({"families": {
            "grid": {"window": [k, k + 1], "ceiling": k + 2, "mix": {str(k): 60, str(k + 2): 20}, "past_range": False}}}))
    page = report_html.write(Paths(tmp_path, 2)).read_text()
    section = page[page.index('id="frontier"'):page.index('id="drift"')]
    first = _episodes(0.2, n=40, seed=1)
    g1 = first[(first["family"] == "grid") & (first["level"] == 1)]
    cell = f"{int(g1['success'].sum())}/{len(g1)}"
    assert section.count(f">{cell}</td>") >= 2  # iteration 1's champion, still champion after iteration 2
    assert "champion after iteration 2" in section and "L2: 60, L4: 20" in section and ">2-3<" in section
