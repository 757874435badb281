"""The data gate: real GX suites from expectations/ on problems and oracle-played trajectories."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from apprentice import gate
from apprentice.config import load_config
from apprentice.data.trajectories import (
    Trajectory,
    problems_frame,
    specs_of,
    trajectories_frame,
    write_parquet,
)
from apprentice.envs import FAMILIES, env_for
from apprentice.paths import Paths
from apprentice.stages import validate

REPO = Path(__file__).resolve().parents[2]


def _problems(n: int, split: str, offset: int) -> pd.DataFrame:
    fams = ["grid", "search"]  # multi-step families, whatever other tests registered
    specs = [FAMILIES[fams[i % len(fams)]].generate(1000 + offset + i, i % 2) for i in range(n)]
    return problems_frame(specs, [i % 2 for i in range(n)], split)


def _oracle_rows(problems: pd.DataFrame) -> pd.DataFrame:
    """Play each problem's oracle through the public tools: a teacher that is always right."""
    rows = []
    for spec, lv in zip(specs_of(problems), problems["level"], strict=True):
        env = env_for(spec)
        task = env.build(spec)
        env.reset(spec=spec)
        msgs = [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": task}]
        for call in env.oracle():
            msgs.append({"role": "assistant", "content": "", "tool_calls": [call.as_message_call()]})
            msgs.append({"role": "tool", "name": call.name, "content": env.execute(call)})
        rows.append(Trajectory(spec.problem_id, spec.family, spec.to_json(), json.dumps(dict(spec.difficulty)),
                               int(lv), "oracle", 0, msgs, type(env).tool_schemas(), env.get_reward(),
                               env.get_reward() >= 1.0, len(msgs) // 2, False))
    return trajectories_frame(rows)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    root = tmp_path_factory.mktemp("gate")
    paths = Paths(root, 1)
    train, held = _problems(6, "train", 0), _problems(4, "eval", 500)
    write_parquet(train, paths.problems)
    write_parquet(held, paths.eval_problems)
    write_parquet(_oracle_rows(train), paths.teacher_trajectories)
    return paths


def _cfg():
    return load_config(REPO / "params.yaml")


def test_clean_data_passes_and_writes_success_only_sft_set(clean):
    out = validate.run(_cfg(), clean)
    assert out["passed"] and out["sft_rows"] == 6
    sft = pd.read_parquet(clean.sft_data)
    assert sft["success"].all() and not sft["truncated"].any()
    summary = json.loads((clean.reports / "gate.json").read_text())
    assert summary["passed"] and summary["failed"] == 0 and summary["expectations"] >= 20
    # same episodes, different timings: the SFT set (DVC dep of sft) stays byte-identical
    first = clean.sft_data.read_bytes()
    teacher = pd.read_parquet(clean.teacher_trajectories)
    write_parquet(teacher.assign(wall_s=teacher["wall_s"] + 1.5), clean.teacher_trajectories)
    validate.run(_cfg(), clean)
    assert clean.sft_data.read_bytes() == first and "wall_s" not in sft.columns


def test_bad_rows_fail_the_gate_with_readable_report(clean, tmp_path):
    paths = Paths(tmp_path, 1)
    problems = pd.read_parquet(clean.problems)
    held = pd.read_parquet(clean.eval_problems)
    teacher = pd.read_parquet(clean.teacher_trajectories)
    bad = teacher.iloc[[0, 1, 2]].copy()  # 3 of 16 rows call a tool that does not exist (> 10%)
    for i in range(len(bad)):
        msgs = json.loads(bad["messages"].iloc[i])
        next(m for m in msgs if m.get("tool_calls"))["tool_calls"][0]["function"]["name"] = "rm_rf"
        bad.iloc[i, bad.columns.get_loc("messages")] = json.dumps(msgs)
    bad["sample_idx"] = 1
    leak = _oracle_rows(held.iloc[[0]])  # an evaluation problem in the training data
    trunc = teacher.copy()
    trunc["truncated"], trunc["sample_idx"] = True, 2  # 6 truncated rows -> rate 0.4 > 0.2
    dup = problems.iloc[[0]]  # duplicate problem id
    hard = problems.iloc[[1]].copy()
    hard["difficulty"] = json.dumps({k: 99 for k in json.loads(hard["difficulty"].iloc[0])})
    write_parquet(pd.concat([problems, dup, hard]), paths.problems)
    write_parquet(held, paths.eval_problems)
    write_parquet(pd.concat([teacher, bad, leak, trunc], ignore_index=True), paths.teacher_trajectories)

    with pytest.raises(gate.GateFailed) as err:
        validate.run(_cfg(), paths)
    msg = str(err.value)
    for expected in ["expect_column_values_to_be_unique(column=problem_id)",
                     "_difficulty_ok", "expect_column_values_to_not_be_in_set(column=problem_id",
                     "_tool_calls_ok", "expect_column_mean_to_be_between(column=truncated"]:
        assert expected in msg, f"{expected!r} missing from:\n{msg}"
    assert not paths.sft_data.exists(), "a failed gate must not write the SFT set"
    page = (paths.reports / "gate.html").read_text()
    assert "FAILED" in page and page.count("class='FAIL'") >= 5
    assert not re.search(r"(src|href)\s*=\s*['\"]?(https?:)?//", page), "report must render offline"


def test_eval_results_suite_rejects_unknown_problem(clean):
    held = pd.read_parquet(clean.eval_problems)
    rows = _oracle_rows(held)
    ids = list(held["problem_id"])
    assert gate.check(rows, "eval_results", {"eval_problem_ids": ids}).success
    res = gate.check(rows, "eval_results", {"eval_problem_ids": ids[1:]})
    assert not res.success and res.failed[0].unexpected_count == 1


def test_eval_results_suite_rejects_a_partial_table():
    """A table that covers only part of the held-out set cannot be compared (the promotion gate)."""
    ids = [f"p{i}" for i in range(5)]
    part = pd.DataFrame({"problem_id": ids[:3], "policy_id": "x", "sample_idx": 0, "success": [True] * 3})
    res = gate.check(part, "eval_results", {"eval_problem_ids": ids})
    assert not res.success
    assert [c.expectation for c in res.failed] == ["expect_column_distinct_values_to_contain_set"]
