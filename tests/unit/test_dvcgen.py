"""dvc.yaml is generated from the params: iterations, per-key params, profile work dirs."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml
from dvcstages import expand

from apprentice import pipeline
from apprentice.config import load_raw
from apprentice.ops import dvcgen

REPO = Path(__file__).resolve().parents[2]


def test_committed_dvc_yaml_matches_params():
    dvcgen.write("default", REPO, check=True)  # raises with the regenerate command when stale


def test_iterations_chain_and_per_key_params():
    raw = load_raw(REPO / "params.yaml")
    raw["pipeline"]["iterations"] = 2
    stages = expand(dvcgen.pipeline(raw, repo=REPO)["stages"])
    assert [s for s in stages if "-2" in s] == [n for s in pipeline.iteration_stages(raw) for n in dvcgen.dvc_stages(s, 2)
                                                if "-2" in n]
    # one benchmark and one base evaluation for all iterations; every iteration reads the same benchmark
    assert [s for s in stages if not re.search(r"-\d+(@|$)", s)] == ["prepare-base", "benchmark", "evaluate-base"]
    assert all(dvcgen.BENCHMARK in stages[dvcgen.eval_stage("rl", k)]["deps"] for k in (1, 2))
    assert dvcgen.BENCHMARK in stages["synth-2"]["deps"]  # training is kept disjoint from it by content
    assert "data/iter_1/eval" in stages["synth-2"]["deps"]  # evolution reads the previous results
    assert "reports/iter_1/promotion.json" in stages["sft-2"]["deps"]  # SFT starts from the champion
    # the base folder is a dep of every SFT (loop.rule=restart starts iteration k from it)
    assert "models/base" in stages["sft-1"]["deps"] and "models/base" in stages["sft-2"]["deps"]
    assert "data/iter_2/train.parquet" in stages["sft-2"]["deps"] and "loop.rule" in stages["sft-2"]["params"]
    assert {"data/iter_1/sft.parquet", "data/iter_2/sft.parquet", "reports/iter_1/promotion.json"} <= \
        set(stages["loop-data-2"]["deps"])  # replay/union read every earlier validated set; self/repair the champion
    assert stages["loop-data-2"]["outs"] == ["data/iter_2/train.parquet", "data/iter_2/champion.parquet"]
    assert "rl.learning_rate" in stages["rl-1"]["params"]
    assert not any(p.startswith("rl.") for s in ("synth-1", "sft-1", "validate-1") for p in stages[s].get("params", []))
    assert "apprentice/stages/rl.py" in stages["rl-1"]["deps"]
    # evolution runs only while RL's generation scheduler reads it (curriculum.evolve.feed > 0): not by default
    assert not [s for s in stages if s.startswith("evolve")] and "data/iter_1/evolve" not in stages["rl-1"]["deps"]
    raw["curriculum"]["evolve"]["feed"] = 2
    stages = expand(dvcgen.pipeline(raw, repo=REPO)["stages"])
    # evolution: its own params, generation 0 of iteration 2 from iteration 1's generations
    assert "curriculum.evolve.generations" in stages["evolve-1"]["params"]
    # RL reads only the scheduler's feed size of evolution's params, and the generations themselves
    assert [p for p in stages["rl-1"]["params"] if p.startswith("curriculum.evolve")] == ["curriculum.evolve.feed"]
    assert "data/iter_1/evolve" in stages["rl-1"]["deps"]
    assert "data/iter_1/evolve" in stages["evolve-2"]["deps"] and stages["evolve-1"]["outs"] == ["data/iter_1/evolve"]


def test_profile_gets_its_own_work_dir(tmp_path):
    for name in ("params.yaml", "apprentice"):
        src = REPO / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, tmp_path / name)
    wd = dvcgen.write("quick", tmp_path)
    assert wd == tmp_path / "runs" / "quick"
    merged = yaml.safe_load((wd / "params.yaml").read_text())
    assert merged == load_raw(tmp_path / "params.yaml", "quick")
    spec = yaml.safe_load((wd / "dvc.yaml").read_text())
    assert "../../apprentice/stages/sft.py" in spec["stages"]["sft-1"]["deps"]
    assert spec["stages"]["sft-1"]["cmd"] == "python -m apprentice sft --params params.yaml --root . --iter 1"


def test_evaluation_is_one_dvc_stage_per_model():
    """So an RL change re-evaluates RL and the student only (base and SFT evaluations stay cached).
    Each iteration's models are one DVC ``matrix`` (DVC expands it; this reads DVC's expansion)."""
    raw = load_raw(REPO / "params.yaml")
    stages = expand(dvcgen.pipeline(raw, repo=REPO)["stages"])
    names = dvcgen.dvc_stages("evaluate", 1)
    assert names == ["evaluate-base", *(f"evaluate-1@{p}" for p in ("sft", "rl", "student"))]
    assert [s for s in stages if s.startswith(("evaluate-base", "evaluate-1"))] == names
    rl = stages["evaluate-1@rl"]
    assert rl["cmd"] == "python -m apprentice evaluate --policy rl --params params.yaml --root . --iter 1"
    assert "models/iter_1/rl" in rl["deps"] and "models/iter_1/sft" not in rl["deps"]
    assert rl["outs"] == ["data/iter_1/eval/rl.parquet", "data/iter_1/eval/rl.json"]
    base = stages["evaluate-base"]
    assert "models/base" in base["deps"] and base["outs"] == ["data/benchmark/eval/base.parquet",
                                                            "data/benchmark/eval/base.json"]
    assert base["cmd"] == "python -m apprentice evaluate --policy base --params params.yaml --root ."
    raw["model"]["base"] = "HuggingFaceTB/SmolLM2-135M-Instruct"  # a hub id: params only, no folder dep
    hub = dvcgen.pipeline(raw, repo=REPO)["stages"]["evaluate-base"]
    assert not any(d.startswith("models/") for d in hub["deps"]) and "model.base" in hub["params"]


def test_per_model_stages_that_do_not_fold_into_a_matrix_fail_at_generation():
    """The matrix template is checked against every model's own stage: a model whose paths do not
    differ from the others' only by its name cannot be silently mis-rendered."""
    spec = {"cmd": "python -m apprentice evaluate --policy sft", "deps": ["models/iter_1/sft"],
            "outs": ["data/iter_1/eval/sft.json"]}
    ok = {m: {k: (v.replace("sft", m) if isinstance(v, str) else [x.replace("sft", m) for x in v])
              for k, v in spec.items()} for m in ("sft", "rl")}
    assert dvcgen._matrix(ok)["deps"] == ["models/iter_1/${item.policy}"]
    bad = {**ok, "rl": {**ok["rl"], "deps": ["models/iter_1/reinforce"]}}
    with pytest.raises(RuntimeError, match="do not fold into one DVC matrix"):
        dvcgen._matrix(bad)


def test_every_declared_param_is_in_params_yaml():
    """DVC refuses a stage whose params name a key the params file lacks (a key with a default in
    config.py but not written in params.yaml, like rollout.engine): every declared param is written there."""
    raw = load_raw(REPO / "params.yaml")
    for name, stage in expand(dvcgen.pipeline(raw, repo=REPO)["stages"]).items():
        for key in stage.get("params", []):
            node = raw
            for part in str(key).split("."):
                assert isinstance(node, dict) and part in node, f"{name}: param {key} is not in params.yaml"
                node = node[part]


def _value(raw: dict, key: str):
    for part in key.split("."):
        raw = raw[part]
    return raw


def test_long_profile_continues_the_default_loop_with_the_same_first_two_iterations():
    """`make run PROFILE=long` measures the champion curve over 4 iterations; its first two
    iterations must be the default's, stage for stage and param for param, so its curve extends the default's."""
    default = load_raw(REPO / "params.yaml")
    long = load_raw(REPO / "params.yaml", "long")
    assert long["pipeline"]["iterations"] >= 4 > default["pipeline"]["iterations"] == 2
    ours = expand(dvcgen.pipeline(default, repo=REPO)["stages"])
    theirs = expand(dvcgen.pipeline(long, "../../", repo=REPO)["stages"])
    assert {s for s in theirs if re.search(r"-[34](@|$)", s)}, "long declares iterations 3 and 4"
    for name, spec in ours.items():
        other = theirs[name]
        assert other["cmd"] == spec["cmd"] and other.get("outs") == spec.get("outs"), name
        assert [d.removeprefix("../../") if isinstance(d, str) else d for d in other["deps"]] == spec["deps"], name
        assert other.get("params", []) == spec.get("params", []), name
        for key in spec.get("params", []):
            assert _value(long, key) == _value(default, key), f"{name}: {key} differs from the default's"
