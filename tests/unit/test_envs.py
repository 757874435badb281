"""grid and search families: reproducibility, oracle validity at every level, rewards, budgets,
robustness to junk arguments, and the TRL ``environment_factory`` surface."""

from __future__ import annotations

import inspect
import json
import re

import pytest

from apprentice.envs import FAMILIES, ProblemSpec, ToolCall, replay, trl_environment
from apprentice.envs.grid import LEVELS as GRID_LEVELS
from apprentice.envs.grid import GridEnv
from apprentice.envs.search import LEVELS as SEARCH_LEVELS
from apprentice.envs.search import SearchEnv

TOOLS = {GridEnv: {"move", "pick_up"}, SearchEnv: {"search", "open", "answer"}}
LEVELS = {GridEnv: GRID_LEVELS, SearchEnv: SEARCH_LEVELS}
PER_LEVEL = 30


def _transcript(cls, spec: ProblemSpec) -> list[str]:
    env = cls()
    out = [env.reset(spec=spec)]
    out += [env.execute(c) for c in env.oracle()]
    return out


def _fresh(cls, seed: int = 7, level: int = 0):
    spec = cls.generate(seed, level)
    env = cls()
    first = env.reset(spec=spec)
    return env, spec, first


def test_families_registered():
    assert FAMILIES["grid"] is GridEnv and FAMILIES["search"] is SearchEnv


@pytest.mark.parametrize("cls", [GridEnv, SearchEnv])
def test_public_functions_are_exactly_tools_and_the_protocol(cls):
    # TRL exposes every public function of the class it gets as a tool (grpo_trainer: getmembers(isfunction)):
    # it gets the facade, whose public functions are the @tool methods, reset and get_reward
    public = {n for n, _ in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}
    assert public == TOOLS[cls] | {"reset", "get_reward", "build", "oracle", "turn_budget", "execute", "ungrounded"}
    assert set(cls.tool_names()) == TOOLS[cls]
    facade = trl_environment(cls)
    assert {n for n, _ in inspect.getmembers(facade, inspect.isfunction) if not n.startswith("_")} == (
        TOOLS[cls] | {"reset", "get_reward"})


@pytest.mark.parametrize("cls", [GridEnv, SearchEnv])
def test_tool_schemas_are_complete(cls):
    schemas = cls.tool_schemas()
    assert {s["function"]["name"] for s in schemas} == TOOLS[cls]
    for s in schemas:
        f = s["function"]
        assert s["type"] == "function" and f["description"].strip()
        params = f["parameters"]
        assert params["type"] == "object"
        for name, p in params["properties"].items():
            assert p["type"] == "string" and p["description"].strip(), (f["name"], name)
        assert set(params.get("required", [])) == set(params["properties"])
        json.dumps(s)  # serialisable for the chat template


@pytest.mark.parametrize("cls", [GridEnv, SearchEnv])
def test_same_seed_same_bytes(cls):
    for level in (0, len(LEVELS[cls]) - 1):
        a, b = cls.generate(11, level), cls.generate(11, level)
        assert a.to_json() == b.to_json() and a.problem_id == b.problem_id
        assert _transcript(cls, a) == _transcript(cls, ProblemSpec.from_json(b.to_json()))
    assert cls.generate(11, 1).problem_id != cls.generate(12, 1).problem_id
    assert _transcript(cls, cls.generate(11, 1)) != _transcript(cls, cls.generate(12, 1))


def test_search_corpus_is_byte_identical():
    spec = SearchEnv.generate(5, 3)
    e1, e2 = SearchEnv(), SearchEnv()
    e1.reset(spec=spec)
    e2.reset(spec=spec.to_json())
    assert json.dumps(e1._docs) == json.dumps(e2._docs)
    assert len(e1._docs) == len(set(e1._docs)) > 10


@pytest.mark.parametrize("cls", [GridEnv, SearchEnv])
def test_oracle_solves_every_generated_problem_at_every_level(cls):
    for level in range(len(LEVELS[cls])):
        lengths = []
        for seed in range(PER_LEVEL):
            spec = cls.generate(1000 * level + seed, level)
            assert dict(spec.difficulty) == LEVELS[cls][level]
            env = cls()
            env.reset(spec=spec)
            plan = env.oracle()
            assert 0 < len(plan) <= env.turn_budget()
            assert replay(cls, spec, plan) == 1.0, (level, spec.to_json())
            lengths.append(len(plan))
        assert max(lengths) <= 4 * max(LEVELS[cls][level].get("size", 0), 4)


def test_generate_without_level_samples_valid_difficulties():
    for cls in (GridEnv, SearchEnv):
        for seed in range(10):
            spec = cls.generate(seed)
            for ax in cls.axes:
                ax.check(spec.difficulty[ax.name])


def test_generate_rejects_impossible_difficulty():
    with pytest.raises(RuntimeError, match="lower one of its axes"):
        GridEnv.generate_from(0, {"size": 4, "obstacles": 0, "keys": 2, "budget_slack": 0})


# ---- grid ------------------------------------------------------------------------------------------

def _offsets(obs: str, what: str) -> dict[str, int]:
    m = re.search(rf"{what}: ([^.]*)\.", obs)
    assert m, obs
    return {d: int(n) for n, d in re.findall(r"(\d+) (up|down|left|right)", m.group(1))}


def test_grid_observations_are_relative_and_consistent():
    for seed in range(20):
        env, _, first = _fresh(GridEnv, seed, level=0)  # no obstacles, no keys: path = Manhattan distance
        assert "(" not in first and "goal:" in first and "blocked:" in first
        assert sum(_offsets(first, "goal").values()) == len(env.oracle())
        for call in env.oracle():
            before = _offsets(env._view(), "goal")
            d = call.arguments["direction"]
            assert before.get(d, 0) > 0, "the oracle moves along a direction the observation names"
            env.execute(call)


def test_grid_oracle_is_a_shortest_path():
    # an independent BFS over cells (keyless levels), against the oracle's (position, keys, doors) search
    from collections import deque

    for level in (1, 2):
        for seed in range(15):
            env, _, _ = _fresh(GridEnv, seed, level)
            b = env._board
            dist, queue = {b.start: 0}, deque([b.start])
            while queue:
                r, c = queue.popleft()
                for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1)):
                    p = (r + dr, c + dc)
                    if 0 <= p[0] < b.n and 0 <= p[1] < b.n and p not in b.walls and p not in dist:
                        dist[p] = dist[(r, c)] + 1
                        queue.append(p)
            assert len(env.oracle()) == dist[b.goal]


def _blocked_start(level: int):
    for seed in range(50):  # the first problem whose start touches a wall or the edge
        env, _, first = _fresh(GridEnv, seed, level=level)
        blocked = re.search(r"blocked: ([^.]*)\.", first).group(1)
        if blocked != "none":
            return env, blocked.split(", ")[0]
    raise AssertionError("no start next to a wall in 50 seeds")


def test_grid_blocked_moves_do_not_move_and_earn_nothing():
    env, wall = _blocked_start(level=1)
    view = env._view()
    obs = env.move(wall)
    assert "did not move" in obs and env._view() == view and env.get_reward() == 0.0


def test_grid_budget_exhaustion_ends_episode_with_zero_reward():
    env, wall = _blocked_start(level=2)
    budget = env.turn_budget()
    outs = [env.move(wall) for _ in range(budget - 1)]
    assert not env.done and all("did not move" in o for o in outs)
    outs.append(env.move("sideways"))  # errors cost an action too
    assert env.done and env.get_reward() == 0.0 and env.turns == budget
    assert "Out of actions" in outs[-1]
    assert env.move("up") == "The episode is over." and env.get_reward() == 0.0 and env.turns == budget


def test_grid_keys_are_needed_and_pick_up_works():
    env, _, first = _fresh(GridEnv, 9, level=4)  # one key, one door
    assert "key A:" in first and "door A:" in first
    plan = env.oracle()
    assert ToolCall("pick_up", {}) in plan
    # skipping the pick-up never reaches the goal through the door
    no_key = [c for c in plan if c.name != "pick_up"]
    assert replay(GridEnv, env.spec, no_key) == 0.0
    assert "nothing to pick up" in env.pick_up()


@pytest.mark.parametrize("junk", [" Up ", "UP", "up.", "'up'", "u", "North", "move up", {"direction": "up"}])
def test_grid_direction_junk_is_understood(junk):
    env, _, _ = _fresh(GridEnv, 5, level=0)
    ref, _, _ = _fresh(GridEnv, 5, level=0)
    assert env.move(junk) == ref.move("up")


@pytest.mark.parametrize("bad", ["sideways", "", None, 3, ["up", "down"], "up or down", "n s"])
def test_grid_bad_direction_is_an_error_observation(bad):
    env, _, _ = _fresh(GridEnv, 5, level=0)
    obs = env.move(bad)
    assert obs.startswith("Error:") and env.turns == 1 and not env.done


def test_bad_tool_calls_through_execute_never_raise():
    for cls in (GridEnv, SearchEnv):
        env, _, _ = _fresh(cls)
        assert env.execute(ToolCall("fly", {})).startswith("Error: unknown tool")
        name = sorted(TOOLS[cls])[-1]
        assert env.execute(ToolCall(name, {"nonsense": 1, "more": 2})).startswith("Error: bad arguments")


def test_env_instances_are_reusable_across_resets():
    # TRL pools environment instances and only calls reset() between episodes
    for cls in (GridEnv, SearchEnv):
        env = cls()
        for seed in (1, 2, 3):
            spec = cls.generate(seed, 1)
            env.reset(spec=spec.to_json(), prompt=[{"role": "user", "content": "x"}])  # a TRL-style row
            assert env.turns == 0 and not env.done and env.get_reward() == 0.0
            for c in env.oracle():
                env.execute(c)
            assert env.get_reward() == 1.0


def test_reset_rejects_other_family_spec():
    with pytest.raises(ValueError, match="given to environment"):
        GridEnv().reset(spec=SearchEnv.generate(0, 0))


# ---- search ----------------------------------------------------------------------------------------

def test_search_wrong_answer_earns_nothing_and_ends():
    env, _, _ = _fresh(SearchEnv, 8, level=1)
    env.search("anything")
    assert env.answer("Nobody Atall") == "Answer recorded; the episode is over."
    assert env.done and env.get_reward() == 0.0
    assert env.answer(env._answer) == "The episode is over." and env.get_reward() == 0.0


def test_search_right_answer_with_junk_formatting():
    env, _, _ = _fresh(SearchEnv, 8, level=1)
    env.answer(f"  the {env._answer.upper()}. ")
    assert env.get_reward() == 1.0


def test_search_ranks_the_described_person_first_and_open_is_forgiving():
    for seed in range(10):
        env, _, first = _fresh(SearchEnv, seed, level=4)  # most distractors
        prof, home = re.search(r"the (\w+) from (\w+)\?", first).groups()
        hits = env.search(f"{prof} from {home}").removeprefix("Results: ").rstrip(".").split("; ")
        assert len(hits) == 3, "distractors crowd the results, so the ranking matters"
        top = hits[0]
        assert env._docs[top].startswith(f"{top} is a {prof}. Home city: {home}.")  # the one matching both
        assert not any(env._docs[h].startswith(f"{h} is a {prof}. Home city: {home}.") for h in hits[1:])
        assert top == env.oracle()[1].arguments["title"]
        assert env.open(f" '{top.lower()}'. ") == env._docs[top]
        assert env.open(top.split()[0]) == env._docs[top]  # unique word of the title


def test_search_bad_arguments_are_error_observations():
    env, _, _ = _fresh(SearchEnv, 2, level=2)
    assert env.turn_budget() > 5
    assert env.search("").startswith("Error:")
    assert env.search(None).startswith("Error:")
    assert env.search("the of").startswith("Error:")
    assert env.open("No Such Article").startswith("Error: no article")
    assert env.open(42).startswith("Error:")
    assert not env.done and env.turns == 5
    assert env.search("zzqx").startswith("No results")  # the last action of the budget: an error, then the end


def test_search_budget_exhaustion_ends_episode():
    env, _, _ = _fresh(SearchEnv, 2, level=0)
    for _ in range(env.turn_budget()):
        out = env.search("painter")
    assert env.done and env.get_reward() == 0.0 and "Out of actions" in out
    assert env.answer(env._answer) == "The episode is over." and env.get_reward() == 0.0


def test_search_articles_and_observations_are_short():
    env, _, first = _fresh(SearchEnv, 3, level=4)
    assert len(first.split()) < 40
    assert all(len(a.split()) <= 20 and a.count(".") <= 5 for a in env._docs.values())


_TRANSCRIPT_SCRIPT = """
import hashlib
from apprentice.envs import env_for
from apprentice.envs.grid import GridEnv
from apprentice.envs.search import SearchEnv
h = hashlib.sha256()
for cls, level in ((GridEnv, 5), (SearchEnv, 4)):
    for seed in range(5):
        spec = cls.generate(seed, level)
        env = env_for(spec)
        h.update(spec.to_json().encode() + env.reset(spec=spec).encode())
        h.update(repr(getattr(env, "_docs", "")).encode())
        for c in env.oracle():
            h.update(env.execute(c).encode())
print(h.hexdigest())
"""


def test_episodes_do_not_depend_on_python_hash_seed():
    import os
    import subprocess
    import sys

    # this process hashes strings with a random seed; the child with hash randomisation off
    child = subprocess.run([sys.executable, "-c", _TRANSCRIPT_SCRIPT], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "0"}, timeout=300).stdout.strip()
    ns: dict = {}
    exec(_TRANSCRIPT_SCRIPT.replace("print(h.hexdigest())", "out = h.hexdigest()"), ns)
    assert child == ns["out"] and len(child) == 64
