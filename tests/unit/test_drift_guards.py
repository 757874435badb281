"""Drift guards: a loop that trains on its own outputs can lose a family or collapse onto a few actions
while its headline score holds, so per iteration the champion's benchmark success per family and its
action diversity (the policy-entropy proxy) are recorded in drift.json (MLflow metrics of the report
run), the report page and the champion-across-iterations chart (an MLflow artifact)."""

from __future__ import annotations

import json

import pandas as pd

from apprentice import pipeline
from apprentice.data.trajectories import problems_frame, trajectories_frame
from apprentice.envs import FAMILIES
from apprentice.evaluation.metrics import action_diversity
from apprentice.ops import report_html
from apprentice.paths import Paths
from apprentice.policies.oracle import OraclePolicy
from apprentice.rollout.episodes import run_episodes
from apprentice.stages import report


class Stuck:
    """A collapsed policy: the same call every turn, whatever it sees."""

    policy_id = "stuck"

    def act(self, conversations, tools, *, contexts=None):  # noqa: ANN001
        from apprentice.policies.base import Turn
        from apprentice.policies.toolcalls import assistant_message, render_assistant

        msg = assistant_message("", [{"name": "move", "arguments": {"direction": "up"}}])
        return [Turn(message=msg, raw=render_assistant(msg)) for _ in conversations]


def _bench() -> pd.DataFrame:
    specs = [FAMILIES[f].generate(10 + i, 1) for i in range(4) for f in ("grid", "search")]
    return problems_frame(specs, [1] * len(specs), "eval")


def test_collapse_shows_in_action_diversity_and_per_family_success(tmp_path):
    bench = _bench()
    good = trajectories_frame(run_episodes(bench, OraclePolicy(), progress=False))
    bad = trajectories_frame(run_episodes(bench, Stuck(), progress=False, max_turns=3))
    dg, db = action_diversity(good), action_diversity(bad)
    assert db["action_entropy"] == 0.0 and dg["action_entropy"] > 1.0
    assert db["distinct_action_ratio"] < dg["distinct_action_ratio"]

    for k, (df, kind) in enumerate(((good, "rl"), (bad, "sft")), 1):
        p = Paths(tmp_path, k)
        p.eval_dir.mkdir(parents=True)
        df.to_parquet(p.eval_episodes(kind))
        p.reports.mkdir(parents=True)
        p.promotion.write_text(json.dumps({"champion": {"kind": kind, "version": k, "iteration": k}}))
    paths = Paths(tmp_path, 2)
    paths.curves_dir.mkdir(parents=True)
    hist = report.write_drift(paths, paths.curves_dir)
    assert [h["iteration"] for h in hist] == [1, 2]
    assert hist[0]["family_grid/success_rate"] == 1.0 and hist[1]["family_search/success_rate"] == 0.0
    rec = json.loads(paths.drift_record.read_text())
    assert rec["champion_action_entropy"] == 0.0 and rec["champion_success_rate"] == 0.0
    assert (paths.curves_dir / "champion.png").read_bytes()[:4] == b"\x89PNG"
    page = report_html.render(report_html.collect(paths))
    assert 'id="drift"' in page and "action entropy" in page and "champion across iterations (drift guard)" in page
    stage = pipeline.get("report")
    assert paths.drift_record in stage.results(paths) and paths.curves_dir / "champion.png" in stage.artifacts(paths)
