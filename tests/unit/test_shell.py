"""``shell`` family: generation without Docker; oracle, verifier, abuse and the rollout engine on a real
engine (skipped with the reason where none answers)."""

from __future__ import annotations

import gc
import inspect

import pytest

from apprentice.envs import FAMILIES, ProblemSpec, ToolCall, evolve, replay
from apprentice.envs.shell import LEVELS, ShellEnv
from apprentice.infra import sandbox as sb

OK, WHY = sb.engine_available()
needs_engine = pytest.mark.skipif(not OK, reason=f"no Docker engine: {WHY}")
TOOLS = {"run", "read_file", "write_file", "submit"}


def _spec(seed: int, level: int) -> ProblemSpec:
    """A spec without the solvability replay (which needs an engine)."""
    return ShellEnv.make_spec(seed, LEVELS[level])


# ---- no engine needed -------------------------------------------------------------------------------
def test_shell_is_registered_with_exactly_its_tools():
    assert FAMILIES["shell"] is ShellEnv
    public = {n for n, _ in inspect.getmembers(ShellEnv, inspect.isfunction) if not n.startswith("_")}
    assert public == TOOLS | {"reset", "get_reward", "build", "oracle", "turn_budget", "execute", "ungrounded"}
    assert set(ShellEnv.tool_names()) == TOOLS  # the @tool methods (TRL sees only these, via trl_environment)
    schemas = {s["function"]["name"]: s["function"] for s in ShellEnv.tool_schemas()}
    assert set(schemas) == TOOLS
    assert set(schemas["write_file"]["parameters"]["required"]) == {"path", "content"}


def test_shell_task_and_oracle_are_reproducible_without_starting_a_container():
    a, b = ShellEnv(), ShellEnv()
    spec = _spec(5, 4)
    assert a.reset(spec=spec) == b.reset(spec=ProblemSpec.from_json(spec.to_json()))
    assert a.oracle() == b.oracle() and a.oracle()[-1] == ToolCall("submit", {})
    assert a._box is None  # reset never starts a container
    assert a.turn_budget() == len(a.oracle()) + 1 + LEVELS[4]["budget_slack"]
    assert a.reset(spec=_spec(6, 4)) != b.reset(spec=spec)
    with pytest.raises(ValueError, match="outside"):
        ShellEnv.make_spec(1, {**LEVELS[0], "tasks": 4})


def test_shell_has_evolution_directions():
    spec = _spec(3, 0)
    scores = evolve.direction_scores(spec)
    assert scores == {"horizon": 0, "state": 0, "harness": 1}  # budget_slack 3 of 4 is one step of harness
    assert evolve.hardness(_spec(3, 4))["tasks"] == 2


# ---- on a real engine -------------------------------------------------------------------------------
@needs_engine
@pytest.mark.parametrize("level", range(len(LEVELS)))
def test_shell_oracle_solves_every_level_through_the_sandbox(level):
    spec = ShellEnv.generate(100 + level, level)  # accepted only if the oracle's replay earns 1.0
    assert dict(spec.difficulty) == LEVELS[level]
    env = ShellEnv()
    env.reset(spec=spec)
    assert replay(ShellEnv, spec, env.oracle()) == 1.0


@needs_engine
def test_shell_verifier_rejects_wrong_and_hardcoded_answers():
    env = ShellEnv()
    for seed in range(100):  # a problem with the script to fix among its three subtasks
        spec = ShellEnv.make_spec(seed, {"tasks": 3, "size": 1, "noise": 1, "budget_slack": 4})
        env.reset(spec=spec)
        if "fix" in [t.kind for t in env._subtasks]:
            break
    assert env.submit().startswith("Submitted: the checks failed") and env.get_reward() == 0.0
    assert len(env.failures) == 3 and env.done and env._box is None

    # the fix subtask: printing the right number without repairing the script fails on fresh data
    env.reset(spec=spec)
    plan = env.oracle()
    for c in plan[:-1]:
        if c.name == "write_file":
            c = ToolCall("write_file", {"path": "scripts/total.sh", "content": "echo $(cat total.txt)"})
            env.execute(ToolCall("run", {"command": "awk '{s+=$2} END {print s}' data/sales.txt > total.txt"}))
        elif "total.sh" in c.arguments.get("command", ""):
            continue
        env.execute(c)
    env.submit()
    assert env.get_reward() == 0.0 and env.failures == ["fix: scripts/total.sh is still wrong"]


@needs_engine
def test_shell_abuse_is_an_error_observation_and_the_episode_goes_on():
    env = ShellEnv()
    env.reset(spec=ShellEnv.make_spec(2, {"tasks": 1, "size": 0, "noise": 0, "budget_slack": 4}))
    assert env.run("while :; do :; done").startswith("Error: the command ran past")
    assert env.write_file("/etc/passwd", "root::0:0::/:/bin/sh").startswith("Error: exit status")
    assert "[output truncated" in env.run("yes | head -c 100000")
    assert env.run("wget -q -T 2 -O- http://example.com").startswith("Error")
    assert env.read_file("").startswith("Error: empty path") and not env.done
    assert env.turns == 5 and env.run("echo still here") == "still here"
    assert env.run("echo last").startswith("last\nOut of actions") and env.turns == env.turn_budget() == 7
    assert env.done and env.get_reward() == 0.0  # that was the last action: verified and over


@needs_engine
def test_shell_instances_are_reused_across_resets_and_free_their_containers():
    env = ShellEnv()  # TRL pools instances and calls reset() between episodes
    seen = set()
    for seed in (1, 2):
        env.reset(spec=ShellEnv.generate(seed, 0).to_json(), prompt=[{"role": "user", "content": "x"}])
        assert env.turns == 0 and not env.done
        env.run("touch mine")
        seen.add(env._box.container_id)
        assert env.run("ls mine") == "mine"  # fresh container: the other episode's file is not there
    env.reset(spec=ShellEnv.generate(3, 0))  # releases the unfinished episode's container
    assert len(seen) == 2 and env._box is None


@needs_engine
def test_shell_runs_in_the_batched_rollout_engine_and_leaves_no_container():
    from apprentice.policies.oracle import OraclePolicy
    from apprentice.rollout.episodes import run_episodes

    specs = [ShellEnv.generate(s, lv) for s, lv in ((21, 0), (22, 1), (23, 2))]
    trajs = run_episodes(specs, OraclePolicy(), samples_per_problem=1, progress=False)
    assert [t.success for t in trajs] == [True] * 3
    assert all(t.tool_errors == 0 and not t.truncated for t in trajs)
    assert trajs[0].tools == ShellEnv.tool_schemas()
    del trajs
    gc.collect()
    import time

    deadline = time.time() + 90  # a loaded vfs engine takes its time to stop what the GC released
    while time.time() < deadline:
        left = [c for c in sb.list_containers(sb.owner_id()) if c["State"] == "running"]
        if len(left) <= sb.SandboxLimits().pool_size:  # only the warm, never-used pool remains
            break
        time.sleep(0.3)
    assert len(left) <= sb.SandboxLimits().pool_size
