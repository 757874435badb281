"""The gate catches corrupted teacher data (a success the calls do not earn, a giant or empty
message, a NaN or out-of-range level, a held-out problem copied into training), names the problems,
and training refuses data it did not pass. Real GX suites, real environments replaying every episode."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
from test_gates import _cfg, _oracle_rows, _problems

from apprentice import gate
from apprentice.data.dedupe import content_key, find_content_duplicates
from apprentice.data.trajectories import problems_frame, trajectories_frame, write_parquet
from apprentice.envs import FAMILIES
from apprentice.paths import Paths
from apprentice.policies.base import Turn
from apprentice.policies.oracle import OraclePolicy
from apprentice.policies.toolcalls import assistant_message, render_assistant
from apprentice.rollout.episodes import run_episodes
from apprentice.stages import validate

#: two grid seeds whose level-0 problems are the same episode (different specs, same content)
TWIN_SEEDS = (11, 292)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Clean train (8) / held-out (4) problems and their oracle episodes."""
    train, held = _problems(8, "train", 0), _problems(4, "eval", 500)
    return train, held, _oracle_rows(train)


def _msgs(df: pd.DataFrame, i: int) -> list[dict]:
    return json.loads(df["messages"].iloc[i])


def _set(df: pd.DataFrame, i: int, col: str, value) -> None:
    df.iloc[i, df.columns.get_loc(col)] = value


def _write(paths: Paths, problems, held, teacher) -> None:
    write_parquet(problems, paths.problems)
    write_parquet(held, paths.eval_problems)
    write_parquet(teacher, paths.teacher_trajectories)


def _cfg_with(**rollout):
    """params.yaml with ``rollout`` settings changed (the config is frozen)."""
    cfg = _cfg()
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update=rollout)})


def _failed(summary: dict) -> dict[str, list[str]]:
    """(suite:table, expectation column) -> the problem ids the report lists for it."""
    out = {}
    for key, suite in summary["suites"].items():
        for c in suite["checks"]:
            if not c["success"]:
                out.setdefault(f"{key.split(':')[0]}/{c['kwargs'].get('column')}", []).extend(c["problem_ids"])
    return out


def test_corruptions_fail_the_gate_naming_each_problem(base, tmp_path):
    train, held, teacher = (x.copy() for x in base)
    teacher = teacher.astype({"level": "float64"})
    paths = Paths(tmp_path, 1)
    pid = list(teacher["problem_id"])
    # 0: success=True but the last call is dropped: the episode never reaches the goal
    m = _msgs(teacher, 0)
    last = max(i for i, x in enumerate(m) if x.get("tool_calls"))
    _set(teacher, 0, "messages", json.dumps(m[:last]))
    # 1: a 100,000-character message
    m = _msgs(teacher, 1)
    m[1]["content"] += "x" * 100_000
    _set(teacher, 1, "messages", json.dumps(m))
    # 2: an assistant turn with empty content and no tool call (no format feedback after it)
    m = _msgs(teacher, 2)
    m.insert(2, {"role": "assistant", "content": ""})
    _set(teacher, 2, "messages", json.dumps(m))
    # 3: NaN level; 4: out-of-range level, both in the teacher file only
    _set(teacher, 3, "level", math.nan)
    _set(teacher, 4, "level", 42)
    # problems: NaN inside a difficulty JSON (must not crash: "cannot convert float NaN to integer")
    d = json.loads(train["difficulty"].iloc[5])
    _set(train, 5, "difficulty", json.dumps({k: math.nan for k in d}))
    # a held-out problem copied into training under a new problem_id (same spec: same content)
    copy = held.iloc[[0]].assign(split="train", problem_id="feedfacefeedface")
    # two seeds that build the same small grid (same task text, same oracle plan), ids consistent
    twins = problems_frame([FAMILIES["grid"].generate(s, 0) for s in TWIN_SEEDS], [0, 0], "train")
    problems = pd.concat([train, copy, twins], ignore_index=True)
    _write(paths, problems, held, teacher)
    paths.sft_data.parent.mkdir(parents=True, exist_ok=True)
    paths.sft_data.write_bytes(b"an SFT set from an earlier run")

    with pytest.raises(gate.GateFailed) as err:
        validate.run(_cfg(), paths)
    msg = str(err.value)
    assert not paths.sft_data.exists(), "a failed gate in the plain CLI must not leave an SFT set behind"
    summary = json.loads(paths.gate_record.read_text())  # the report is written despite the NaN
    assert not summary["passed"] and (paths.reports / "gate.html").exists()
    failed = _failed(summary)
    assert pid[0] in failed["trajectories/_replay_ok"], failed  # mislabelled success, named
    assert pid[1] in failed["trajectories/_message_lengths_ok"]
    assert pid[2] in failed["trajectories/_transcript_ok"]
    assert set(failed["trajectories/level"]) == {pid[3], pid[4]}
    assert train["problem_id"].iloc[5] in failed["problems/_difficulty_ok"]
    assert "feedfacefeedface" in failed["problems/_content_key"]  # copied held-out problem
    assert set(twins["problem_id"]) <= set(failed["problems/_content_key"])  # within-training twins
    assert "feedfacefeedface" in failed["problems/_spec_id_ok"]
    for needle in ["_replay_ok", "_message_lengths_ok", "_content_key", "data/iter_1/problems.parquet",
                   "column=level", pid[0]]:
        assert needle in msg, f"{needle!r} missing from:\n{msg}"

    # sft refuses the data of a failed gate, even if someone puts a file back
    from apprentice.stages import sft

    write_parquet(teacher, paths.sft_data)
    with pytest.raises(gate.GateFailed, match="gate FAILED"):
        sft.run(_cfg(), paths)


class _ErrsFirst(OraclePolicy):
    """The oracle, after one bad first turn per episode (``mode``): a real rollout of a teacher that errs."""

    needs_oracle_plan = True

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def act(self, conversations, tools, *, contexts=None):
        out = []
        for conv, ctx in zip(conversations, contexts, strict=True):
            asked = [i for i, m in enumerate(conv) if m.get("role") == "assistant"]
            if not asked:
                name = "rm_rf" if self.mode == "unknown_tool" else ctx["oracle_plan"][0]["name"]
                args = {"path": "/"} if self.mode == "unknown_tool" else {"bogus": 1}
                if self.mode == "parse_error":
                    out.append(Turn(message={"role": "assistant", "content": "I will move"}, raw="I will move",
                                    parse_error="no tool call found in your reply"))
                    continue
                msg = assistant_message("", [{"name": name, "arguments": args}])
                out.append(Turn(message=msg, raw=render_assistant(msg)))
                continue
            rest = [m for i, m in enumerate(conv) if i != asked[0]]  # the plan goes on as if it never erred
            out.extend(super().act([rest], [tools[0]], contexts=[ctx]))
        return out


def test_excluded_episodes_are_counted_listed_and_never_trained_on(base, tmp_path):
    train, held, teacher = (x.copy() for x in base)
    paths = Paths(tmp_path, 1)
    # 40 episodes (5 per problem); 3 come from teachers that err once and then solve the problem:
    # an unknown tool, arguments off the tool's schema, a reply without a tool call (format feedback)
    teacher = pd.concat([teacher.assign(sample_idx=k) for k in range(5)], ignore_index=True)
    erring = []
    for i, mode in enumerate(["unknown_tool", "bad_arguments", "parse_error"]):
        row = trajectories_frame(run_episodes(train.iloc[[i]], _ErrsFirst(mode), progress=False, max_turns=20))
        assert row["success"].all(), mode
        erring.append(row.assign(policy_id="oracle", sample_idx=0))
    pid = list(train["problem_id"])
    teacher = teacher[~((teacher["sample_idx"] == 0) & teacher["problem_id"].isin(pid[:3]))]
    # and one failed episode (success_only keeps it out)
    failed = teacher[(teacher["sample_idx"] == 0) & (teacher["problem_id"] == pid[3])].copy()
    m = _msgs(failed, 0)
    first_tool = next(i for i, x in enumerate(m) if x["role"] == "tool")
    failed = failed.assign(messages=json.dumps(m[: first_tool + 1]), success=False, reward=0.0)
    teacher = teacher[~((teacher["sample_idx"] == 0) & (teacher["problem_id"] == pid[3]))]
    teacher = pd.concat([teacher, *erring, failed], ignore_index=True)
    assert len(teacher) == 40
    _write(paths, train, held, teacher)

    out = validate.run(_cfg_with(samples_per_problem=5), paths)  # the teacher may err (3 in 40); the SFT set must not
    assert out["passed"] and out["sft_excluded"] == 4 and out["sft_rows"] == 36
    sft = pd.read_parquet(paths.sft_data)
    assert not ((sft["sample_idx"] == 0) & sft["problem_id"].isin(pid[:4])).any()
    summary = json.loads(paths.gate_record.read_text())
    listed = {e["problem_id"]: e["reason"] for e in summary["excluded_episodes"]}
    assert "unknown tool 'rm_rf'" in listed[pid[0]], listed
    assert "off its schema" in listed[pid[1]] and listed[pid[2]].startswith("malformed turn")
    assert listed[pid[3]] == "not a success"
    assert summary["sft_excluded_by_reason"] == {"invalid tool call": 2, "malformed turn": 1, "not a success": 1}
    page = (paths.reports / "gate.html").read_text()
    assert "excluded from the SFT set: 4" in page and all(p in page for p in pid[:4])
    gate.require_passed(paths.sft_data, paths.gate_record)
    write_parquet(sft.iloc[:2], paths.sft_data)  # changed after validation
    with pytest.raises(gate.GateFailed, match="SHA-256"):
        gate.require_passed(paths.sft_data, paths.gate_record)


def test_missing_columns_fail_the_gate_naming_them(base, tmp_path):
    train, held, teacher = (x.copy() for x in base)
    paths = Paths(tmp_path, 1)
    _write(paths, train, held, teacher.drop(columns=["success", "tools"]))
    with pytest.raises(gate.GateFailed) as err:  # not a KeyError
        validate.run(_cfg(), paths)
    msg = str(err.value)
    assert "expect_column_to_exist(column=success)" in msg and "expect_column_to_exist(column=tools)" in msg
    assert json.loads(paths.gate_record.read_text())["passed"] is False


def test_sft_suite_has_zero_tolerance(base):
    """Even a hand-made SFT set (selection bypassed) with one bad call in many fails its suite."""
    teacher = pd.concat([base[2]] * 5, ignore_index=True)
    m = _msgs(teacher, 0)
    next(x for x in m if x.get("tool_calls"))["tool_calls"][0]["function"]["name"] = "rm_rf"
    _set(teacher, 0, "messages", json.dumps(m))
    res = gate.check(teacher, "sft_data", {"allowed_success": [True], "eval_problem_ids": [],
                                            "max_message_chars": 20000})
    bad = {c.kwargs["column"]: c for c in res.failed}
    assert set(bad) == {"_tool_calls_ok", "_replay_ok", "_audit_ok"} and bad["_tool_calls_ok"].unexpected_count == 1


def test_content_duplicates_found_across_and_within_sets(base):
    train, held, _ = base
    a, b = (FAMILIES["grid"].generate(s, 0) for s in TWIN_SEEDS)
    assert a.problem_id != b.problem_id and content_key(a) == content_key(b.to_json())
    leaked = held.iloc[[1]].assign(problem_id="0000000000000000")
    table = pd.concat([train, leaked], ignore_index=True)
    rows = [*table.to_dict("records"), {"problem_id": a.problem_id, "spec": a.to_json()}, b]
    dups = find_content_duplicates(rows, against=[held])
    assert dups == {"0000000000000000": [held["problem_id"].iloc[1]], b.problem_id: [a.problem_id]}


def test_default_synth_plan_emits_no_content_duplicates(tmp_path):
    """Two seeds can build the same small grid problem, so a plan could put a held-out problem (same
    task text and oracle plan, another seed) in training or repeat a task text within training;
    synthesis regenerates such slots, and the default plan ends with no content duplicates."""
    from apprentice.stages import benchmark, synth

    cfg = _cfg()
    paths = Paths(tmp_path, 1)
    benchmark.run(cfg, paths)
    synth.run(cfg, paths)
    train, ev = pd.read_parquet(paths.problems), pd.read_parquet(paths.eval_problems)
    assert len(train) == cfg.synth.n_train and len(ev) == cfg.benchmark.n
    assert find_content_duplicates(ev) == {}
    assert find_content_duplicates(train, against=[ev]) == {}
