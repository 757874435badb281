"""Adapters: Reasoning Gym datasets and gymnasium toy-text through the Environment protocol."""

from __future__ import annotations

import pytest

from apprentice.envs import FAMILIES, ToolCall, replay

pytest.importorskip("gymnasium")
adapters = pytest.importorskip("apprentice.envs.adapters")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.mark.parametrize("family", ["toytext_frozenlake", "toytext_taxi"])
def test_toytext_oracle_solves_every_level(family):
    cls = adapters.ensure(family)
    assert FAMILIES[family] is cls and cls.tool_names() == ["act"]
    for level in (0, 1, 2, 4, None):
        for seed in range(4):
            spec = cls.generate(seed, level)
            env = cls()
            text = env.reset(spec=spec)
            plan = env.oracle()
            assert text and len(plan) <= env.turn_budget()
            assert replay(cls, spec, plan) == 1.0


def test_frozenlake_hole_or_budget_ends_without_reward():
    cls = adapters.ensure("toytext_frozenlake")
    spec = cls.make_spec(0, {"size": 4, "holes": 0, "budget_slack": 0})
    env = cls()
    env.reset(spec=spec)
    assert env.execute(ToolCall("act", {"action": "jump"})).startswith("Error")
    for _ in range(env.turn_budget()):
        env.execute(ToolCall("act", {"action": "left"}))  # bumping the wall wastes the budget
    assert env.done and env.get_reward() == 0.0


def test_frozenlake_larger_level_is_harder():
    cls = adapters.ensure("toytext_frozenlake")
    easy, hard = cls.sample_difficulty(None, 0), cls.sample_difficulty(None, 3)
    assert hard["size"] > easy["size"] and hard["holes"] > easy["holes"]
    assert hard["budget_slack"] < easy["budget_slack"]  # more slack is easier


def test_reasoning_gym_submit_with_retries_and_feedback():
    pytest.importorskip("reasoning_gym")
    cls = adapters.register_reasoning_gym("basic_arithmetic")
    assert {a.name for a in cls.axes} == {"num_terms", "num_digits", "retries"}
    for level in (0, 1, 3):
        spec = cls.generate(level, level)
        assert replay(cls, spec, _oracle(cls, spec)) == 1.0
    spec = cls.make_spec(5, {"num_terms": 0, "num_digits": 0, "retries": 1})
    env = cls()
    env.reset(spec=spec)
    answer = env.oracle()[0].arguments["answer"]
    assert env.execute(ToolCall("submit", {"answer": "not a number"})) == "Incorrect. Attempts left: 1."
    assert not env.done
    assert env.execute(ToolCall("submit", {"answer": answer})) == "Correct." and env.get_reward() == 1.0
    env.reset(spec=spec)
    env.execute(ToolCall("submit", {"answer": "x"}))
    assert env.execute(ToolCall("submit", {"answer": "y"})).endswith("No attempts left.") and env.done
    assert env.get_reward() == 0.0


def test_reasoning_gym_unknown_dataset_says_how_to_fix():
    pytest.importorskip("reasoning_gym")
    with pytest.raises(ValueError, match="choose from"):
        adapters.register_reasoning_gym("no_such_dataset")


def _oracle(cls, spec):
    env = cls()
    env.reset(spec=spec)
    return env.oracle()
