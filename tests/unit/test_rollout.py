"""The batched rollout engine on a tiny counting environment and scripted policies (no model)."""

from __future__ import annotations

import json
import os

import pandas as pd
import pytest

from apprentice.data.trajectories import (
    TRAJECTORY_COLUMNS,
    problems_frame,
    read_parquet,
    to_sft_records,
    trajectories_frame,
    write_parquet,
)
from apprentice.envs.base import DifficultyAxis, Environment, ProblemSpec, ToolCall, tool
from apprentice.policies.base import Turn
from apprentice.rollout.episodes import run_episodes


class CounterEnv(Environment):
    """Reach ``steps`` with ``inc`` then ``submit``; ``jump`` rejects non-positive amounts."""

    family = "counter_test"
    axes = (DifficultyAxis("steps", 1, 6),)
    system_prompt = "Count up to the target, then submit."

    def build(self, spec: ProblemSpec) -> str:
        self.target = int(spec.difficulty["steps"])
        self.count = 0
        return f"Reach {self.target}."

    def oracle(self) -> list[ToolCall]:
        return [ToolCall("inc", {})] * self.target + [ToolCall("submit", {})]

    def turn_budget(self) -> int:
        return self.target + 2

    @tool
    def inc(self) -> str:
        """Add one to the counter."""
        self.count += 1
        return f"count={self.count}"

    @tool
    def jump(self, by: int) -> str:
        """Add ``by`` to the counter.

        Args:
            by: A positive amount.
        """
        if by <= 0:
            return f"Error: by must be positive, got {by}"
        self.count += by
        return f"count={self.count}"

    @tool
    def submit(self) -> str:
        """Finish the episode."""
        self.done = True
        self.reward = 1.0 if self.count == self.target else 0.0
        return "correct" if self.reward else "wrong"


def _specs(steps: list[int]) -> list[ProblemSpec]:
    return [CounterEnv.make_spec(seed=i, difficulty={"steps": s}) for i, s in enumerate(steps)]


def _turn(*calls: ToolCall, content: str = "") -> Turn:
    msg = {"role": "assistant", "content": content, "tool_calls": [c.as_message_call() for c in calls]}
    return Turn(message=msg, prompt_tokens=10, completion_tokens=3)


class PlanPolicy:
    """Follows the privileged plan (like the oracle), recording the batch of every act call."""

    policy_id = "plan"
    needs_oracle_plan = True

    def __init__(self) -> None:
        self.batches: list[int] = []

    def act(self, conversations, tools, *, contexts=None):
        assert contexts is not None and len(contexts) == len(conversations)
        self.batches.append(len(conversations))
        out = []
        for conv, ctx in zip(conversations, contexts, strict=True):
            step = sum(m["role"] == "assistant" for m in conv)
            c = ctx["oracle_plan"][step]
            out.append(_turn(ToolCall(c["name"], c["arguments"])))
        return out


class FnPolicy:
    """Answers every conversation with ``fn(conversation)``."""

    policy_id = "fn"

    def __init__(self, fn) -> None:
        self.fn = fn

    def act(self, conversations, tools, *, contexts=None):
        assert contexts is None, "only policies that ask for it get privileged context"
        return [self.fn(c) for c in conversations]


def _env(spec: ProblemSpec) -> Environment:
    return CounterEnv()


def test_plan_policy_solves_all_and_records_whole_trajectories():
    specs = _specs([1, 3, 2])
    trajs = run_episodes(specs, PlanPolicy(), env_factory=_env, progress=False, levels=[0, 2, 1])
    assert [t.success for t in trajs] == [True, True, True]
    assert [t.turns for t in trajs] == [2, 4, 3]
    t = trajs[1]
    assert (t.problem_id, t.level, t.policy_id, t.truncated) == (specs[1].problem_id, 2, "plan", False)
    assert ProblemSpec.from_json(t.spec) == specs[1]
    roles = [m["role"] for m in t.messages]
    assert roles == ["system", "user"] + ["assistant", "tool"] * 4
    assert t.messages[0]["content"] == CounterEnv.system_prompt and t.messages[1]["content"] == "Reach 3."
    assert t.messages[3] == {"role": "tool", "name": "inc", "content": "count=1"}
    assert {s["function"]["name"] for s in t.tools} == {"inc", "jump", "submit"}
    assert (t.prompt_tokens, t.completion_tokens) == (40, 12)
    assert "oracle_plan" not in json.dumps(t.messages)


def test_one_act_call_per_round_with_all_live_episodes():
    specs = _specs([1, 4, 2, 3])
    pol = PlanPolicy()
    run_episodes(specs, pol, samples_per_problem=2, env_factory=_env, progress=False)
    # 8 episodes with 2,5,3,4 turns: each round batches every episode still running
    assert pol.batches == [8, 8, 6, 4, 2]


def test_batch_size_caps_live_episodes_and_a_finished_one_hands_its_place_on():
    pol = PlanPolicy()
    run_episodes(_specs([2, 2, 2, 2, 2]), pol, batch_size=2, env_factory=_env, progress=False)
    assert pol.batches == [2] * 6 + [1] * 3
    # episodes of 2, 5, 2, 2 turns: the long one keeps playing while the short ones take turns beside
    # it, so no round runs a lone episode until the queue is empty (lock-step rounds of all live
    # episodes, chunked, made 7 calls: [2, 2, 2, 2, 1, 1, 1])
    pol = PlanPolicy()
    trajs = run_episodes(_specs([1, 4, 1, 1]), pol, batch_size=2, env_factory=_env, progress=False)
    assert [t.turns for t in trajs] == [2, 5, 2, 2] and all(t.success for t in trajs)
    assert pol.batches == [2, 2, 2, 2, 2, 1]


def test_a_policy_that_holds_fewer_conversations_than_asked_gets_no_more_at_once():
    class Holding(PlanPolicy):
        def live_rows(self, batch_size):  # as CachedHFPolicy does when its store holds half the live episodes
            self.asked = batch_size
            return batch_size // 2

    pol = Holding()
    trajs = run_episodes(_specs([2, 2, 2, 2, 2]), pol, batch_size=4, env_factory=_env, progress=False)
    assert pol.asked == 4 and all(t.success for t in trajs)
    assert pol.batches == [2] * 6 + [1] * 3  # exactly the rounds of batch_size=2


def test_the_largest_turn_budgets_are_admitted_first_and_results_keep_spec_order():
    # episodes of 2, 2, 2, 5 turns, 2 at a time: admitted in spec order, the long one starts last and
    # plays its last 3 turns alone ([2, 2, 2, 2, 1, 1, 1]); admitted first, it plays beside the others
    specs = _specs([1, 1, 1, 4])
    pol = PlanPolicy()
    trajs = run_episodes(specs, pol, batch_size=2, env_factory=_env, progress=False)
    assert pol.batches == [2, 2, 2, 2, 2, 1]
    assert [t.problem_id for t in trajs] == [s.problem_id for s in specs]
    assert [t.turns for t in trajs] == [2, 2, 2, 5]


def test_budget_truncates_unfinished_episodes():
    pol = FnPolicy(lambda conv: _turn(ToolCall("inc", {})))
    trajs = run_episodes(_specs([3, 1]), pol, env_factory=_env, progress=False)
    assert [(t.turns, t.truncated, t.success, t.reward) for t in trajs] == [(5, True, False, 0.0), (3, True, False, 0.0)]
    capped = run_episodes(_specs([3]), pol, max_turns=2, env_factory=_env, progress=False)
    assert (capped[0].turns, capped[0].truncated, capped[0].extra["budget"]) == (2, True, 2)


def test_parse_errors_become_observations_and_are_counted():
    def fn(conv):
        n = sum(m["role"] == "assistant" for m in conv)
        if n == 0:
            return Turn({"role": "assistant", "content": "<tool_call>{oops"}, parse_error="invalid JSON", raw="<tool_call>{oops")
        if n == 1:
            return Turn({"role": "assistant", "content": "I think the answer is 1."})  # no tool call at all
        if n == 2:  # arguments that are not a JSON object
            return Turn({"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "inc", "arguments": "[1]"}}]})
        return _turn(ToolCall("jump", {"by": 4}) if n == 3 else ToolCall("submit", {}))

    (t,) = run_episodes(_specs([4]), FnPolicy(fn), env_factory=_env, progress=False)
    assert t.parse_errors == 3 and t.success and t.turns == 5 and t.tool_errors == 0
    errors = [m for m in t.messages if m["role"] == "user"][1:]
    assert len(errors) == 3
    assert all(m["content"].startswith("Error:") and "<tool_call>" in m["content"] for m in errors)
    assert "invalid JSON" in errors[0]["content"] and "no tool call" in errors[1]["content"]
    assert not any(m.get("tool_calls") for m in t.messages[2:7])  # no half call left in the transcript


def test_consecutive_format_errors_end_the_episode_when_asked():
    prose = FnPolicy(lambda conv: Turn({"role": "assistant", "content": "Sure! Let me think."}))
    (t,) = run_episodes(_specs([3]), prose, env_factory=_env, progress=False, max_format_errors=2)
    assert (t.turns, t.parse_errors, t.success, t.truncated, t.extra["stopped"]) == (2, 2, False, False, "format_errors")
    (full,) = run_episodes(_specs([3]), prose, env_factory=_env, progress=False)  # default: never stop early
    assert full.turns == full.extra["budget"] and "stopped" not in full.extra

    def recovers(conv):  # error, good call, error, good call...: the streak resets, the episode goes on
        n = sum(m["role"] == "assistant" for m in conv)
        return Turn({"role": "assistant", "content": "hm"}) if n % 2 == 0 else _turn(ToolCall("inc", {}))

    (r,) = run_episodes(_specs([2]), FnPolicy(recovers), env_factory=_env, progress=False, max_format_errors=2)
    assert r.parse_errors == 2 and "stopped" not in r.extra


def test_an_agent_repeating_the_same_step_is_stopped_when_asked():
    """The same call with the same observation ``max_repeats`` turns in a row ends the episode; the same
    call with a new observation each time (progress) does not, nor does a failed parse in between."""
    stuck = FnPolicy(lambda conv: _turn(ToolCall("jump", {"by": 0})))  # "Error: ..." every time, nothing changes
    (t,) = run_episodes(_specs([3]), stuck, env_factory=_env, progress=False, max_repeats=3)
    assert (t.turns, t.success, t.truncated, t.extra["stopped"]) == (3, False, False, "repeats")
    (full,) = run_episodes(_specs([3]), stuck, env_factory=_env, progress=False)  # default: never stop early
    assert full.turns == full.extra["budget"] and "stopped" not in full.extra

    counting = FnPolicy(lambda conv: _turn(ToolCall("inc", {})) if sum(m["role"] == "assistant" for m in conv) < 4
                        else _turn(ToolCall("submit", {})))
    (c,) = run_episodes(_specs([4]), counting, env_factory=_env, progress=False, max_repeats=2)
    assert c.success and "stopped" not in c.extra  # inc, inc, inc, inc: the same call, a new count each time

    def interrupted(conv):  # stuck, a parse error, stuck again: the streak restarts after the error
        n = sum(m["role"] == "assistant" for m in conv)
        return Turn({"role": "assistant", "content": "hm"}) if n == 2 else _turn(ToolCall("jump", {"by": 0}))

    (i,) = run_episodes(_specs([6]), FnPolicy(interrupted), env_factory=_env, progress=False, max_repeats=3)
    assert i.turns == 6 and i.extra["stopped"] == "repeats"  # 2 stuck, 1 error, 3 stuck


def test_tool_errors_are_counted_and_do_not_stop_the_episode():
    script = [ToolCall("fly", {}), ToolCall("jump", {"by": -1}), ToolCall("jump", {"height": 2}),
              ToolCall("jump", {"by": 3}), ToolCall("submit", {})]
    pol = FnPolicy(lambda conv: _turn(script[sum(m["role"] == "assistant" for m in conv)]))
    (t,) = run_episodes(_specs([3]), pol, env_factory=_env, progress=False)
    assert (t.tool_errors, t.parse_errors, t.success, t.turns) == (3, 0, True, 5)
    tool_msgs = [m["content"] for m in t.messages if m["role"] == "tool"]
    assert tool_msgs[0].startswith("Error: unknown tool 'fly'")


def test_several_calls_in_one_turn_run_in_order_until_done():
    pol = FnPolicy(lambda conv: _turn(ToolCall("inc", {}), ToolCall("inc", {}), ToolCall("submit", {}), ToolCall("inc", {})))
    (t,) = run_episodes(_specs([2]), pol, env_factory=_env, progress=False)
    assert t.success and t.turns == 1 and t.extra["tool_calls"] == 3


def test_levels_come_from_the_problems_table():
    specs = _specs([1, 2])
    df = problems_frame(specs, [5, 7], split="train")
    trajs = run_episodes(df, PlanPolicy(), env_factory=_env, progress=False)
    assert [t.level for t in trajs] == [5, 7]


def test_wrong_number_of_turns_is_a_clear_error():
    class Bad:
        policy_id = "bad"

        def act(self, conversations, tools, *, contexts=None):
            return []

    with pytest.raises(RuntimeError, match="exactly one Turn per conversation"):
        run_episodes(_specs([1]), Bad(), env_factory=_env, progress=False)


def test_trajectories_round_trip_through_parquet(tmp_path):
    trajs = run_episodes(_specs([1, 2]), PlanPolicy(), env_factory=_env, progress=False)
    path = write_parquet(trajectories_frame(trajs), tmp_path / "t.parquet")
    df = read_parquet(path)
    assert list(df.columns) == TRAJECTORY_COLUMNS and len(df) == 2
    rec = to_sft_records(df)[1]
    assert rec["messages"] == trajs[1].messages and rec["tools"] == trajs[1].tools


def test_parquet_write_is_atomic(tmp_path):
    trajs = run_episodes(_specs([1]), PlanPolicy(), env_factory=_env, progress=False)
    target = tmp_path / "teacher.parquet"
    write_parquet(trajectories_frame(trajs), target)
    before = target.read_bytes()
    bad = trajectories_frame(trajs)
    bad["reward"] = [object()]  # pyarrow cannot serialise this: the write fails part-way
    with pytest.raises(Exception):  # noqa: B017 - pyarrow raises one of several error types
        write_parquet(bad, target)
    assert target.read_bytes() == before  # the previous complete file is untouched
    with pytest.raises(Exception):  # noqa: B017
        write_parquet(bad, tmp_path / "new.parquet")
    assert sorted(os.listdir(tmp_path)) == ["teacher.parquet"]  # no partial file, no temp left behind
    pd.testing.assert_frame_equal(read_parquet(target), trajectories_frame(trajs))


def test_oracle_policy_solves_every_real_family_at_every_level():
    from apprentice.envs import FAMILIES
    from apprentice.infra.sandbox import engine_available
    from apprentice.policies.oracle import OraclePolicy

    families = {name: cls for name, cls in FAMILIES.items() if name != "shell" or engine_available()[0]}  # shell: Docker
    specs = [cls.generate(seed, level) for cls in families.values() for level in (0, 1, 2) for seed in (11, 12)]
    trajs = run_episodes(specs, OraclePolicy(), progress=False)
    assert len(trajs) == len(specs) and {t.family for t in trajs} == set(families)
    failed = [(t.family, t.difficulty, t.turns) for t in trajs if not t.success]
    assert not failed, f"oracle failed on {failed}"
    assert not any(t.truncated or t.parse_errors or t.tool_errors for t in trajs)


def test_episode_token_budget_counts_tool_responses_like_grpo():
    """episode_tokens budgets generated + tool-response tokens (GRPO's max_completion_length): the
    oracle solves every problem unbudgeted, and fails once the budget is below its transcript."""
    from apprentice.envs import FAMILIES
    from apprentice.policies.oracle import OraclePolicy
    from apprentice.rollout.episodes import run_episodes

    specs = [FAMILIES["search"].generate(seed=i, level=2) for i in range(3)]
    words = lambda s: len(s.split())  # noqa: E731 - a stand-in token counter
    free = run_episodes(specs, OraclePolicy(), progress=False)
    assert all(t.success for t in free)
    cut = run_episodes(specs, OraclePolicy(), progress=False, episode_tokens=5, count_tokens=words)
    assert not any(t.success for t in cut) and all(t.truncated and t.extra["stopped"] == "episode_tokens" for t in cut)
    roomy = run_episodes(specs, OraclePolicy(), progress=False, episode_tokens=100_000, count_tokens=words)
    assert [t.success for t in roomy] == [t.success for t in free]
    with pytest.raises(ValueError, match="count_tokens"):
        run_episodes(specs, OraclePolicy(), progress=False, episode_tokens=5)
