"""A stage whose output nothing reads does not run: the evolve stage is in the pipeline only while RL's
generation scheduler reads its generations (``curriculum.evolve.feed`` > 0).

Why: evolve ran every iteration and RL waited on its outputs, yet with the shipped params (feed 0) RL
never opens them. The registry (:attr:`apprentice.pipeline.Stage.needed`) now leaves such a stage, and
the deps on its outputs, out of ``dvc.yaml`` and the flow's order; turning the consumer on brings both
back. Every other stage is declared exactly as before (same command, params, code and data deps, outs),
so it computes the same thing.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from dvcstages import expand

from apprentice import pipeline
from apprentice.config import PROFILES_DIR, load_config, load_raw
from apprentice.ops import dvcgen

REPO = Path(__file__).resolve().parents[2]
PROFILES = ["default", *sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))]


def _stages(raw: dict) -> dict:
    return expand(dvcgen.pipeline(raw, repo=REPO)["stages"])


@pytest.mark.parametrize("profile", PROFILES)
def test_evolve_runs_exactly_when_its_generations_are_fed_to_rl(profile):
    raw = load_raw(REPO / "params.yaml", profile)
    fed = raw["curriculum"]["evolve"]["feed"] > 0
    stages = _stages(raw)
    n = raw["pipeline"]["iterations"]
    assert [s for s in stages if s.startswith("evolve")] == ([f"evolve-{k}" for k in range(1, n + 1)] if fed else [])
    for k in range(1, n + 1):
        assert (f"data/iter_{k}/evolve" in stages[f"rl-{k}"]["deps"]) == fed
    cfg = load_config(REPO / "params.yaml", profile)
    assert ("evolve" in pipeline.iteration_stages(cfg)) == fed
    assert pipeline.iteration_stages(cfg) == pipeline.iteration_stages(raw)  # a Config and its mapping agree


def test_shipped_params_run_no_evolve_stage():
    raw = load_raw(REPO / "params.yaml")
    assert raw["curriculum"]["evolve"]["feed"] == 0
    assert "evolve" not in pipeline.iteration_stages(raw)
    committed = dvcgen.render(raw, "params.yaml")
    assert "evolve-" not in committed and "/evolve" not in committed
    assert (REPO / "dvc.yaml").read_text() == committed


def test_turning_the_feed_on_brings_evolve_back_and_changes_no_other_stage():
    off = load_raw(REPO / "params.yaml")
    on = copy.deepcopy(off)
    on["curriculum"]["evolve"]["feed"] = 2
    a, b = _stages(off), _stages(on)
    assert [s for s in b if s not in a] == ["evolve-1", "evolve-2"]
    assert list(a) == [s for s in b if s in a]  # the same order otherwise
    assert pipeline.iteration_stages(on) == pipeline.iteration_stages()  # every registered stage
    assert b["evolve-2"]["deps"][-1] == "data/iter_1/evolve" and b["evolve-1"]["outs"] == ["data/iter_1/evolve"]
    for name, spec in a.items():
        other = dict(b[name])
        if name.startswith("rl-"):
            k = name.removeprefix("rl-")
            assert f"data/iter_{k}/evolve" in other["deps"]
            other["deps"] = [d for d in other["deps"] if d != f"data/iter_{k}/evolve"]
        assert other == spec, f"{name} changed with curriculum.evolve.feed"


def test_the_evolve_verb_stays_and_the_registry_keeps_the_stage():
    """Off the pipeline is not off the CLI: ``python -m apprentice evolve`` still runs it by hand."""
    from apprentice.__main__ import _parser

    assert "evolve" in _parser()._actions[1].choices
    stage = pipeline.get("evolve")
    assert stage.in_pipeline and stage.needed is not None
    assert not pipeline.runs(stage, {"curriculum": {"evolve": {"feed": 0}}})
    assert not pipeline.runs(stage, {})  # feed's class default is 0
    assert pipeline.runs(stage, {"curriculum": {"evolve": {"feed": 1}}})
    assert pipeline.runs(stage)  # no params: every registered stage
