"""Every way a transcript can lie, caught and named. A clean 40-episode teacher table (real
rollout engine, oracle teacher, grid/search/store) passes untouched; each corruption class below
damages a few rows, and every damaged episode is named (problem id + sample, and the check) in the
CLI output and in gate.html, and never reaches sft.parquet. Classes that no honest rollout produces
fail the gate; classes an honest teacher can produce are excluded while the gate passes."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
from test_gates import _cfg

from apprentice import gate
from apprentice.data.dedupe import task_key
from apprentice.data.trajectories import problems_frame, trajectories_frame, write_parquet
from apprentice.envs import FAMILIES
from apprentice.paths import Paths
from apprentice.policies.oracle import OraclePolicy
from apprentice.rollout.episodes import run_episodes
from apprentice.rollout.shards import failed_episode
from apprentice.stages import validate

FAMS = ("grid", "search", "store")
SAMPLES = 4


def _config(**rollout):
    cfg = _cfg()
    return cfg.model_copy(update={"synth": cfg.synth.model_copy(update={"families": list(FAMS)}),
                                  "rollout": cfg.rollout.model_copy(update={"samples_per_problem": SAMPLES, **rollout})})


@pytest.fixture(scope="module")
def data():
    """10 training problems (grid, search, store; levels 0-2) x 4 oracle samples = 40 rows; 4 held out."""
    specs = [FAMILIES[FAMS[i % 3]].generate(7000 + i, 1 + i % 2) for i in range(10)]
    train = problems_frame(specs, [1 + i % 2 for i in range(10)], "train")
    held = problems_frame([FAMILIES[FAMS[i % 3]].generate(9000 + i, i % 3) for i in range(4)], [i % 3 for i in range(4)], "eval")
    teacher = trajectories_frame(run_episodes(train, OraclePolicy(), samples_per_problem=SAMPLES, progress=False))
    assert len(teacher) == 40 and teacher["success"].all()
    return train, held, teacher


def _row(df: pd.DataFrame, family: str, sample: int = 0, nth: int = 0) -> int:
    idx = [i for i in range(len(df)) if df["family"].iloc[i] == family and df["sample_idx"].iloc[i] == sample]
    return idx[nth]


def _edit(df: pd.DataFrame, i: int, fn) -> None:
    msgs = json.loads(df["messages"].iloc[i])
    df.iloc[i, df.columns.get_loc("messages")] = json.dumps(fn(msgs) or msgs)


def _set(df: pd.DataFrame, i: int, col: str, value) -> None:
    df.iloc[i, df.columns.get_loc(col)] = value


def _name(df: pd.DataFrame, i: int) -> str:
    return gate.episode_name(df["problem_id"].iloc[i], int(df["sample_idx"].iloc[i]))


def _calls(msgs):
    return [k for k, m in enumerate(msgs) if m.get("tool_calls")]


def _gate(tmp_path, capsys, train, held, teacher, cfg=None):
    """Run validate; (passed, CLI text, gate.html, SFT set or None)."""
    paths = Paths(tmp_path, 1)
    write_parquet(train, paths.problems)
    write_parquet(held, paths.eval_problems)
    write_parquet(teacher, paths.teacher_trajectories)
    try:
        validate.run(cfg or _config(), paths)
        passed, err = True, ""
    except gate.GateFailed as e:
        passed, err = False, str(e)
    out = capsys.readouterr().out + err
    sft = pd.read_parquet(paths.sft_data) if paths.sft_data.exists() else None
    return passed, out, paths.gate_html.read_text(), sft


def _assert_caught(result, named: dict[str, str], teacher: pd.DataFrame, fails: bool) -> None:
    passed, out, page, sft = result
    assert passed is not fails, out
    for episode, check in named.items():
        assert episode in out and episode in page, f"{episode} not named:\n{out}"
        line = [ln for ln in out.splitlines() if episode in ln]
        assert any(check in ln for ln in line) or check in out, f"{check} not named for {episode}:\n{out}"
    if sft is not None:
        kept = {gate.episode_name(p, int(k)) for p, k in zip(sft["problem_id"], sft["sample_idx"], strict=True)}
        assert not kept & set(named), f"bad rows reached sft.parquet: {kept & set(named)}"
        assert len(sft) == len(teacher) - len(named)


def test_clean_data_passes_untouched(data, tmp_path, capsys):
    train, held, teacher = data
    passed, out, page, sft = _gate(tmp_path, capsys, train, held, teacher)
    assert passed and sft is not None and len(sft) == 40, out
    assert "excluded" not in out and "Episodes excluded" not in page


# ---- classes that fail the gate: no honest rollout records them ---------------------------------

def test_environment_messages_must_be_what_the_environment_renders(data, tmp_path, capsys):
    train, held, t = (x.copy() for x in data)
    a, b, c, d = _row(t, "grid"), _row(t, "search"), _row(t, "store"), _row(t, "grid", 1)
    _edit(t, a, lambda m: m[0].update(content=m[0]["content"] + " Ignore the budget."))  # system prompt
    _edit(t, b, lambda m: m[1].update(content=m[1]["content"].replace("What", "Which", 1).replace("Who", "Which", 1)))
    _edit(t, c, lambda m: m[1].update(content=json.loads(t["messages"].iloc[_row(t, "store", 0, 1)])[1]["content"]))
    # a forged "feedback" turn: an assistant reply without a call, then words the environment never says
    _edit(t, d, lambda m: m[2:2] if m.insert(2, {"role": "assistant", "content": "hmm"}) or
          m.insert(3, {"role": "user", "content": "The key is two steps up."}) else None)
    r = _gate(tmp_path, capsys, train, held, t)
    _assert_caught(r, {_name(t, i): "_env_messages_ok" for i in (a, b, c, d)}, t, fails=True)
    assert "environment messages differ" in r[1]


def test_protocol_each_call_one_result_in_order_nothing_after_the_end(data, tmp_path, capsys):
    train, held, t = (x.copy() for x in data)
    rows = [_row(t, f, s) for f in FAMS for s in (1, 2)]

    def drop_result(m):  # a call whose result is missing (the next call follows it)
        del m[_calls(m)[0] + 1]

    def two_results(m):
        k = _calls(m)[0] + 1
        m.insert(k + 1, dict(m[k]))

    def wrong_name(m):
        k = _calls(m)[0] + 1
        m[k]["name"] = "submit_all"

    def early_call(m):  # the second call made before the first result arrived
        k = _calls(m)[1]
        m.insert(_calls(m)[0] + 1, m.pop(k))

    def after_end(m):  # a whole new turn after the terminal step
        m.append({"role": "assistant", "content": "", "tool_calls": [m[_calls(m)[0]]["tool_calls"][0]]})
        m.append({"role": "tool", "name": m[-1]["tool_calls"][0]["function"]["name"], "content": "OK."})

    def wrong_id(m):
        k = _calls(m)[0]
        m[k]["tool_calls"][0]["id"] = "call_1"
        m[k + 1]["tool_call_id"] = "call_2"

    for i, fn in zip(rows, (drop_result, two_results, wrong_name, early_call, after_end, wrong_id), strict=True):
        _edit(t, i, fn)
    r = _gate(tmp_path, capsys, train, held, t)
    _assert_caught(r, {_name(t, i): "_protocol_ok" for i in rows}, t, fails=True)


def test_replay_and_reward_must_agree_with_the_environment(data, tmp_path, capsys):
    train, held, t = (x.copy() for x in data)
    a, b, c, d = _row(t, "grid", 3), _row(t, "search", 3), _row(t, "store", 3), _row(t, "search", 2)
    _set(t, a, "reward", 0.0)  # success true, reward 0
    _set(t, b, "success", False)  # reward 1, success false
    _set(t, c, "reward", 0.5)
    _set(t, c, "success", False)  # consistent with each other, not with the environment
    _edit(t, d, lambda m: m[_calls(m)[0] + 1].update(content="Results: Nobody."))  # a forged observation
    r = _gate(tmp_path, capsys, t_train := train, held, t)
    assert t_train is train
    _assert_caught(r, {_name(t, a): "reward", _name(t, b): "replay", _name(t, c): "replay", _name(t, d): "replay"},
                   t, fails=True)


def test_duplicates_by_content_regardless_of_ids(data, tmp_path, capsys):
    train, held, t = (x.copy() for x in data)
    copy_beyond = t.iloc[[0]].assign(sample_idx=SAMPLES)  # sample index past samples_per_problem
    copy_policy = t.iloc[[5]].assign(policy_id="teacher-b")  # same episode under another policy id
    same_ids = t.iloc[[9]]  # an exact copy
    t2 = pd.concat([t, copy_beyond, copy_policy, same_ids], ignore_index=True)
    passed, out, page, sft = _gate(tmp_path, capsys, train, held, t2)
    assert not passed
    assert gate.episode_name(t["problem_id"].iloc[0], SAMPLES) in out
    assert "column=sample_idx" in out and "policy_id" in out
    assert "expect_compound_columns_to_be_unique(column_list=[\"problem_id\", \"sample_idx\"])" in out


def test_contamination_by_normalised_task_text(data, tmp_path, capsys):
    train, held, t = (x.copy() for x in data)
    bench = json.loads(  # a held-out problem's task, case, spacing and punctuation changed
        trajectories_frame(run_episodes(held.iloc[[1]], OraclePolicy(), progress=False))["messages"].iloc[0])[1]["content"]
    reworded = "  " + bench.upper().replace("?", " ?!").replace(" ", "   ") + "."
    assert task_key(reworded) == task_key(bench) and reworded != bench
    i = _row(t, "search", 1)
    _edit(t, i, lambda m: m[1].update(content=reworded))
    r = _gate(tmp_path, capsys, train, held, t)
    _assert_caught(r, {_name(t, i): "_task_key"}, t, fails=True)


def test_families_come_from_the_config_not_the_data(data, tmp_path, capsys):
    train, held, t = data
    cfg = _config()  # grid, search, store
    narrow = cfg.model_copy(update={"synth": cfg.synth.model_copy(update={"families": ["grid", "search"]})})
    passed, out, page, _ = _gate(tmp_path, capsys, train, held, t, narrow)
    assert not passed and "column=family" in out
    store = t[t["family"] == "store"]
    for p, k in zip(store["problem_id"], store["sample_idx"], strict=True):
        assert gate.episode_name(p, int(k)) in out


def test_plugin_families_are_allowed(data):
    from apprentice.envs import FAMILIES as REG

    class Plugin(FAMILIES["grid"]):  # a family registered from outside the package
        family = "plugin_grid_n"

    Plugin.__module__ = "third_party.envs"
    REG[Plugin.family] = Plugin
    try:
        assert "plugin_grid_n" in validate.allowed_families(["grid"])
        assert "search" not in validate.allowed_families(["grid"])
    finally:
        del REG[Plugin.family]


@pytest.mark.parametrize("spec_edit,why", [
    (lambda d: d["difficulty"].update(hops=9), "outside search's range"),
    (lambda d: d.update(seed=math.inf), "not a finite integer"),
    (lambda d: d.update(seed=math.nan), "not a finite integer"),
    (lambda d: d.update(seed=2.5), "not a finite integer"),
    (lambda d: d["difficulty"].pop("hops"), "axes"),
    (lambda d: d.update(family="no_such_family"), "unknown environment family"),
])
def test_spec_values_outside_the_environment_are_named_failures(data, spec_edit, why):
    _, _, t = data
    i = _row(t, "search", 1)
    d = json.loads(t["spec"].iloc[i])
    spec_edit(d)
    bad = json.dumps(d)  # Infinity / NaN as JSON writes them
    assert why in gate.spec_problem(bad)
    found = gate.audit_episode(bad, t["messages"].iloc[i], t["tools"].iloc[i], True, 1.0)
    assert why in found["spec"]


def test_out_of_range_axis_and_infinity_seed_fail_validate_by_name(data, tmp_path, capsys):
    """An out-of-range difficulty axis and an infinite seed fail the gate by name instead of crashing
    `validate` (IndexError building the world, OverflowError on int(inf))."""
    train, held, t = (x.copy() for x in data)
    train = train.copy()
    a, b = _row(t, "search", 1), _row(t, "grid", 2)
    for i, edit in ((a, lambda d: d["difficulty"].update(hops=9)), (b, lambda d: d.update(seed=math.inf))):
        d = json.loads(t["spec"].iloc[i])
        edit(d)
        _set(t, i, "spec", json.dumps(d))
        j = int((train["problem_id"] == t["problem_id"].iloc[i]).to_numpy().nonzero()[0][0])
        _set(train, j, "spec", json.dumps(d))
    r = _gate(tmp_path, capsys, train, held, t)
    _assert_caught(r, {_name(t, a): "_spec_valid_ok", _name(t, b): "_spec_valid_ok"}, t, fails=True)
    assert "invalid spec" in r[1] and "outside search's range" in r[1] and "not a finite integer" in r[1]


# ---- classes that exclude: an honest teacher can produce them; the gate passes ------------------

def test_text_hygiene_in_content_and_arguments_excludes(data, tmp_path, capsys):
    train, held, t = (x.copy() for x in data)
    rows = [_row(t, f, s) for f in ("search", "grid") for s in (1, 2, 3)]
    bad = ["zzq\x07", "nul\x00 here", "\x1b[31mred\x1b[0m", "lone \ud83d surrogate", "donâ€™t", "caf\u00c3\u00a9"]
    for n, (i, text) in enumerate(zip(rows, bad, strict=True)):
        if n == 0:  # in a call's arguments (search's query: the same words, so the same results)
            def in_args(m, text=text):
                fn = m[_calls(m)[0]]["tool_calls"][0]["function"]
                fn["arguments"]["query"] += " " + text
            _edit(t, i, in_args)
        else:
            _edit(t, i, lambda m, text=text: m[_calls(m)[0]].update(content=text))
    r = _gate(tmp_path, capsys, train, held, t)
    _assert_caught(r, {_name(t, i): "hygiene" for i in rows}, t, fails=False)


@pytest.mark.parametrize("text", ["a\x00b", "\x1b[2J", "x\x1b]0;title\x07", "ok\x0b", "\ud800", "Ã©tÃ©", "â€œquotedâ€\x9d",
                                  "\u202eevil", "zero\u200bwidth", "bad \ufffd byte"])
def test_text_problem_names_each_kind(text):
    assert gate.text_problem(text), text


@pytest.mark.parametrize("text", ["plain text", "tabs\tand\nnewlines\r\n", "café naïve über", "Zürich — “quoted”",
                                  "emoji 😀", "日本語", "#12 blue mug $3.50"])
def test_text_problem_passes_clean_text(text):
    assert gate.text_problem(text) == "", text


def test_ungrounded_actions_and_privileged_information_exclude(data, tmp_path, capsys):
    train, held, t = (x.copy() for x in data)
    s1, s2, st, s3, s4 = (_row(t, "search", 1), _row(t, "search", 2), _row(t, "store", 1), _row(t, "search", 3),
                          _row(t, "store", 2))

    def skip_search(m):  # opens the top title without searching: nothing showed it
        k = _calls(m)[0]
        del m[k:k + 2]

    def skip_lookup(m):  # uses the product id without the look-up that shows it
        k = next(k for k in _calls(m) if m[k]["tool_calls"][0]["function"]["name"].startswith(("find_", "list_")))
        del m[k:k + 2]

    def reveal_answer(m):  # states the hidden answer in its first turn, before any observation
        answer = m[_calls(m)[-1]]["tool_calls"][0]["function"]["arguments"]["text"]
        m[_calls(m)[0]]["content"] = f"I already know it is {answer}."

    def reveal_plan(m):
        m[_calls(m)[0]]["content"] = "Following the oracle plan."

    _edit(t, s1, skip_search)
    _edit(t, st, skip_lookup)
    _edit(t, s2, reveal_answer)
    _edit(t, s3, reveal_plan)
    _edit(t, s4, lambda m: m[_calls(m)[0]].update(oracle_plan=[c["tool_calls"] for c in m if c.get("tool_calls")]))
    r = _gate(tmp_path, capsys, train, held, t)
    _assert_caught(r, {_name(t, s1): "ungrounded", _name(t, st): "ungrounded", _name(t, s2): "privileged",
                       _name(t, s3): "privileged", _name(t, s4): "privileged"}, t, fails=False)


def test_a_call_left_without_result_after_the_end_excludes(data, tmp_path, capsys):
    train, held, t = (x.copy() for x in data)
    i = _row(t, "grid", 2)
    _edit(t, i, lambda m: m[_calls(m)[-1]]["tool_calls"].append(m[_calls(m)[0]]["tool_calls"][0]))
    r = _gate(tmp_path, capsys, train, held, t)
    _assert_caught(r, {_name(t, i): "after_end"}, t, fails=False)


def test_rollout_failures_within_the_error_budget_are_excluded_and_named(data, tmp_path, capsys):
    train, held, t = (x.copy() for x in data)
    rows = [_row(t, "search", 1), _row(t, "store", 2)]
    failed = [failed_episode(train[train["problem_id"] == t["problem_id"].iloc[i]].iloc[0], int(t["sample_idx"].iloc[i]),
                             str(t["policy_id"].iloc[i]), TimeoutError("read timed out")) for i in rows]
    t2 = t.drop(index=rows)
    t2 = pd.concat([t2, trajectories_frame(failed)], ignore_index=True)
    names = {gate.episode_name(f.problem_id, f.sample_idx): "rollout failed" for f in failed}
    r = _gate(tmp_path, capsys, train, held, t2, _config(error_budget=0.1))
    _assert_caught(r, names, t2, fails=False)
    assert "read timed out" in r[1]
    # past the budget: the gate fails, naming them
    r = _gate(tmp_path / "strict", capsys, train, held, t2, _config(error_budget=0.0))
    assert not r[0] and "_rollout_failed" in r[1]
    assert all(n in r[1] for n in names)


@pytest.mark.parametrize("family", ["grid", "search", "store", pytest.param("shell", marks=pytest.mark.slow)])
def test_no_false_positives_at_scale(family):
    """200 problems of each built-in family, every level, oracle rollouts: not one rejection (shell: 20,
    in Docker: slow)."""
    if family == "shell":
        from apprentice.infra.sandbox import Sandbox

        try:
            Sandbox().close()
        except Exception as e:  # noqa: BLE001 - no Docker here
            pytest.skip(f"shell needs a Docker sandbox: {e}")
    cls = FAMILIES[family]
    n = 200 if family != "shell" else 20
    specs = [cls.generate(50_000 + i, i % 5) for i in range(n)]
    rows = trajectories_frame(run_episodes(problems_frame(specs, [i % 5 for i in range(n)], "train"), OraclePolicy(),
                                           progress=False))
    assert gate.episode_rejections(rows, True, 20000) == []
    res = gate.check(rows, "trajectories", {
        "max_truncation_rate": 0.0, "min_success_rate": 1.0, "eval_problem_ids": [], "families": [family],
        "train_problem_ids": [s.problem_id for s in specs], "max_message_chars": 20000, "error_budget": 0.0,
        "max_sample_idx": 0, "forbidden_tasks": []})
    assert res.success, res.summary()


def test_default_pipeline_data_passes_every_check(tmp_path):
    """The default synth plan (200 problems), its benchmark and oracle rollouts: no rejection at all."""
    from apprentice.stages import benchmark, rollout, synth

    cfg = _cfg()
    paths = Paths(tmp_path, 1)
    benchmark.run(cfg, paths)
    synth.run(cfg, paths)
    rollout.run(cfg, paths, progress=False)
    out = validate.run(cfg, paths)
    assert out["passed"] and out["sft_excluded"] == 0 and out["sft_rows"] == cfg.synth.n_train
