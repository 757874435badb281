"""The stage registry (apprentice/pipeline.py) is the one description of a stage.

The CLI verbs, ``dvc.yaml``, the Prefect tasks, the flow's order and what lineage logs all derive
from it: a new stage is its module and one registry entry (the throwaway stage below proves it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from apprentice import pipeline
from apprentice.__main__ import _parser, main
from apprentice.config import load_raw
from apprentice.ops import dvcgen
from apprentice.paths import Paths
from apprentice.pipeline import IO, NoCache, Stage

REPO = Path(__file__).resolve().parents[2]

THROWAWAY = '''"""A throwaway stage: counts the problems of iteration k (the test's proof of "one module, one entry")."""
import json


def run(cfg, paths, **_):
    out = paths.reports / "hello.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"iteration": paths.iteration, "seed": cfg.pipeline.seed}))
    return {"wrote": str(out)}
'''


@pytest.fixture
def hello(tmp_path, monkeypatch) -> Stage:
    """A new stage, added as its module (outside the repo) + one registry entry after ``report``."""
    (tmp_path / "hello_stage.py").write_text(THROWAWAY)
    monkeypatch.syspath_prepend(str(tmp_path))
    stage = Stage("hello", "hello_stage", params=("pipeline.seed",),
                  io=lambda w: IO(deps=[w.paths.promotion], metrics=[NoCache(w.paths.reports / "hello.json")]),
                  results=lambda p: [p.reports / "hello.json"], retries=1)
    at = [s.name for s in pipeline.STAGES].index("report") + 1
    monkeypatch.setattr(pipeline, "STAGES", (*pipeline.STAGES[:at], stage, *pipeline.STAGES[at:]))
    return stage


def test_a_new_stage_is_one_module_and_one_entry(hello, tmp_path):
    # the CLI: a verb that runs the module's run(cfg, paths)
    assert "hello" in _parser()._actions[1].choices
    root = tmp_path / "work"
    assert main(["hello", "--params", str(REPO / "params.yaml"), "--root", str(root), "--iter", "2"]) == 0
    assert json.loads((root / "reports" / "iter_2" / "hello.json").read_text()) == {"iteration": 2, "seed": 0}
    # dvc.yaml: one DVC stage per iteration, after report, with its params per key, deps and metrics
    raw = load_raw(REPO / "params.yaml")
    raw["pipeline"]["iterations"] = 2
    stages = dvcgen.pipeline(raw, repo=REPO)["stages"]
    assert list(stages).index("hello-1") == list(stages).index("report-1") + 1 and list(stages)[-1] == "hello-2"
    assert stages["hello-2"] == {
        "cmd": "python -m apprentice hello --params params.yaml --root . --iter 2",
        "deps": ["hello_stage.py", *dvcgen.COMMON_DEPS, "reports/iter_2/promotion.json"],
        "params": ["pipeline.seed"], "metrics": [{"reports/iter_2/hello.json": {"cache": False}}]}
    assert yaml.safe_load(dvcgen.render(raw, "params.yaml"))["stages"]["hello-1"]["cmd"].endswith("--iter 1")
    # the flow: in the order, with a Prefect task carrying the declared retries
    from flows.self_improve import stage_order
    from tasks.stages import stage_task

    assert stage_order(1)[-1] == stage_order(2)[-1] == "hello"
    task = stage_task("hello")
    assert task.name == "hello" and task.retries == 1
    # lineage: the result file run_stage reads for its metrics
    assert hello.results(Paths(root, 2)) == [root / "reports" / "iter_2" / "hello.json"]


def test_registry_reproduces_the_tables_it_replaced():
    """The values the hand-kept tables held before the registry (CLI verbs, flow order, retries, lineage)."""
    assert set(pipeline.verbs()) == {"prepare-base", "benchmark", "synth", "rollout", "teacher-rollout", "validate",
                                     "sft", "rl", "distill", "evaluate", "evaluate-all", "promote", "report", "evolve",
                                     "loop-data", "frontier"}
    assert pipeline.get("rollout").name == "teacher-rollout"
    assert pipeline.once_stages() == ["prepare-base", "benchmark"]
    # loop-data (the set SFT trains on, mixed by loop.rule) between validate and sft
    assert pipeline.iteration_stages() == ["frontier", "synth", "evolve", "teacher-rollout", "validate", "loop-data", "sft", "rl",
                                           "distill", "evaluate", "promote", "report"]
    assert {s.name: s.retries for s in pipeline.STAGES if s.retries} == {
        "teacher-rollout": pipeline.ROLLOUT_RETRIES, "evaluate": pipeline.ROLLOUT_RETRIES}
    assert [(s.name, s.curve) for s in pipeline.curve_stages()] == [("sft", "sft"), ("rl", "rl"), ("distill", "student")]
    p = Paths(Path("w"), 3)
    rel = {s.name: ([f.as_posix() for f in s.results(p)], [f.as_posix() for f in s.artifacts(p)], s.tags)
           for s in pipeline.STAGES}
    assert {k: v[0] for k, v in rel.items() if v[0]} == {
        "benchmark": ["w/data/benchmark/benchmark.json"], "evolve": ["w/data/iter_3/evolve.json"],
        "validate": ["w/reports/iter_3/gate.json"], "sft": ["w/reports/iter_3/sft_start.json"],
        "loop-data": ["w/reports/iter_3/loop.json"], "report": ["w/reports/iter_3/drift.json"],
        "frontier": ["w/reports/iter_3/frontier.json"],
        "evaluate": ["w/data/benchmark/eval/base.json", "w/data/iter_3/eval/sft.json", "w/data/iter_3/eval/rl.json",
                     "w/data/iter_3/eval/student.json"],
        "promote": ["w/reports/iter_3/promotion.json"]}
    assert {k: v[1] for k, v in rel.items() if v[1]} == {
        "validate": ["w/reports/iter_3/gate.html", "w/reports/iter_3/gate.json"],
        "promote": ["w/reports/iter_3/promotion.json"],
        "report": ["w/reports/iter_3/index.html", "w/reports/iter_3/curves/eval.md", "w/reports/iter_3/drift.json",
                   "w/reports/iter_3/curves/champion.png", "w/reports/iter_3/curves/sft.png",
                   "w/reports/iter_3/curves/rl.png", "w/reports/iter_3/curves/distill.png"]}
    assert {k: v[2] for k, v in rel.items() if v[2]} == {"sft": ("start_model.",), "promote": ("champion.",),
                                                          "loop-data": ("rule", "start")}


def test_unknown_stage_names_the_choices():
    with pytest.raises(KeyError, match="choose from"):
        pipeline.get("sfft")
