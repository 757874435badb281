"""The ``store`` family: every generated problem is solved by its oracle; wrong final states fail."""

from __future__ import annotations

import dataclasses

import pytest

from apprentice.envs import FAMILIES, ProblemSpec, ToolCall, replay
from apprentice.envs.store import StoreDB, StoreEnv


def _specs():
    for level in (0, 1, 2, 3, 5, None):
        for seed in range(8):
            yield StoreEnv.generate(seed, level)


def test_registered_and_tools_have_schemas():
    assert FAMILIES["store"] is StoreEnv
    names = {s["function"]["name"] for s in StoreEnv.tool_schemas()}
    assert {"place_order", "cancel_order", "restock", "find_product", "send_email"} <= names
    assert "generate" not in names and "oracle_plan" not in names


def test_oracle_solves_every_generated_problem_at_every_level():
    for spec in _specs():
        plan = StoreEnv.oracle_plan(spec)
        assert replay(StoreEnv, spec, plan) == 1.0, spec
        env = StoreEnv()
        env.reset(spec=spec)
        assert len(plan) <= env.turn_budget()


def test_same_spec_same_episode_bytes():
    spec = StoreEnv.generate(3, 2)
    a, b = StoreEnv(), StoreEnv()
    assert a.reset(spec=spec.to_json()) == b.reset(spec=ProblemSpec.from_json(spec.to_json()))
    assert a.oracle() == b.oracle()


def test_wrong_final_states_fail():
    spec = StoreEnv.generate(7, 2)
    plan = StoreEnv.oracle_plan(spec)
    writes = [i for i, c in enumerate(plan) if c.name in {"place_order", "restock", "cancel_order"}]
    # 1) the last write is missing
    assert replay(StoreEnv, spec, plan[: writes[-1]]) == 0.0
    # 2) a wrong quantity somewhere
    bad = list(plan)
    i = writes[0]
    args = dict(bad[i].arguments)
    if "quantity" in args:
        args["quantity"] = args["quantity"] + 1
    else:
        args["order_id"] = args["order_id"] + 1
    bad[i] = ToolCall(bad[i].name, args)
    assert replay(StoreEnv, spec, bad) == 0.0
    # 3) a distractor write first (the instruction never asks for e-mail)
    assert replay(StoreEnv, spec, [ToolCall("send_email", {"customer_id": 1, "message": "hi"}), *plan]) == 0.0


def test_repaired_mistake_still_passes():
    """Placing a wrong order and cancelling it again leaves the goal state reachable."""
    spec = StoreEnv.generate(11, 1)
    env = StoreEnv()
    env.reset(spec=spec)
    out = env.execute(ToolCall("place_order", {"customer_id": 1, "product_id": 1, "quantity": 1}))
    oid = int(out.split("#")[1].split()[0])
    env.execute(ToolCall("cancel_order", {"order_id": oid}))
    for c in env.oracle():
        env.execute(c)
    assert env.get_reward() == 1.0


def test_bad_input_is_an_observation_not_an_exception():
    env = StoreEnv()
    env.reset(spec=StoreEnv.generate(0, 2))
    for call in [
        ToolCall("place_order", {"customer_id": "x", "product_id": 1, "quantity": 1}),
        ToolCall("place_order", {"customer_id": 1, "product_id": 999, "quantity": 1}),
        ToolCall("cancel_order", {"order_id": 12345}),
        ToolCall("find_product", {"query": "no such thing"}),
        ToolCall("nope", {}),
        ToolCall("restock", {"product_id": 1}),
    ]:
        assert env.execute(call).startswith("Error")
    assert env.get_reward() == 0.0


def test_harness_changes_help_not_problem():
    spec = StoreEnv.generate(4, 1)
    d = dict(spec.difficulty)
    helped = StoreEnv()
    t0 = helped.reset(spec=dataclasses.replace(spec, difficulty={**d, "harness": 0}))
    terse = StoreEnv()
    t2 = terse.reset(spec=dataclasses.replace(spec, difficulty={**d, "harness": 2}))
    assert "Plan:" in t0 and "Plan:" not in t2
    assert terse.execute(ToolCall("cancel_order", {"order_id": 999})) == "Error."


@pytest.mark.parametrize("scale", [0, 1, 2])
def test_larger_scale_extends_the_world(scale):
    small, big = StoreDB(9, scale, 0), StoreDB(9, scale + 1, 0)
    rows = small.con.execute("SELECT * FROM products").fetchall()
    assert rows == big.con.execute(f"SELECT * FROM products WHERE id<={len(rows)}").fetchall()
    assert len(big.con.execute("SELECT * FROM customers").fetchall()) > len(
        small.con.execute("SELECT * FROM customers").fetchall())


def test_rollout_engine_with_oracle_policy_solves_store():
    from apprentice.policies.oracle import OraclePolicy
    from apprentice.rollout.episodes import run_episodes

    specs = [StoreEnv.generate(i, i % 4) for i in range(8)]
    trajs = run_episodes(specs, OraclePolicy(), progress=False)
    assert all(t.success and not t.truncated and t.tool_errors == 0 for t in trajs)
