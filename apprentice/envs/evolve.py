"""Environment evolution: off-policy operators that make generation g+1 harder than generation g.

The method is environment evolution for terminal agents: difficulty is raised *off-policy* along
three directions derived from the multi-turn learning objective, and evolved generations enter
training one at a time. Here the three directions are explicit maps from each family's difficulty axes:

  * ``horizon``  more required steps (store: ops; grid: keys);
  * ``state``    a larger world (store: scale; grid: size, then obstacles);
  * ``harness``  less help and more ambiguity (store: look-ups, then terse harness, then
                 distractors; grid: less budget slack).

An operator moves a spec one step along the first axis of its direction that still has room, keeps
the seed (so a store world *grows* instead of being replaced) and re-checks solvability through the
public tools (oracle replay = 1.0), stepping to derived seeds only if the evolved vector has no
solvable instance at that seed. Lineage (parent id, operator) goes in ``spec.extra``.

Why no LLM mutator (the paper uses a multi-agent harness): our families are parametric, so a
difficulty step is a spec edit with a verifiable oracle; the hard part the paper solves with agents
(keeping an edited Docker environment solvable) is here a replay check.

Also here: :func:`direction_scores` (the per-direction position the samplers and the difficulty
predictor read), :func:`abilities_of` (AES's ability tags), the fixed *reference policy* used to
measure that each generation is harder (an oracle that slips into a random tool call with
probability epsilon before each step: it has no learning, so its pass rate moves only with the
problems). Which generation joins training is a curriculum decision:
:mod:`apprentice.curriculum.schedule` (``GenerationScheduler``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import random
import re
import typing
from collections.abc import Sequence
from typing import Any

from apprentice.envs import FAMILIES, Environment, ProblemSpec, ToolCall, replay


def derive_seed(seed: int, *parts: Any) -> int:
    """A 63-bit seed from ``seed`` and labels, stable across runs and machines."""
    return int(hashlib.sha256(":".join(map(str, (seed, *parts))).encode()).hexdigest()[:15], 16)

DIRECTION_NAMES = ("horizon", "state", "harness")

#: family -> direction -> [(axis, sign)]; sign -1 marks an axis where *lower* is harder.
DIRECTIONS: dict[str, dict[str, list[tuple[str, int]]]] = {
    "store": {
        "horizon": [("ops", 1)],
        "state": [("scale", 1)],
        "harness": [("lookups", 1), ("harness", 1), ("distractors", 1)],
    },
    "grid": {
        "horizon": [("keys", 1)],
        "state": [("size", 1), ("obstacles", 1)],
        "harness": [("budget_slack", -1)],
    },
    "search": {
        "horizon": [("hops", 1)],
        "state": [("corpus", 1)],
        "harness": [("distractors", 1), ("budget_slack", -1)],
    },
}


def directions_of(family: str) -> dict[str, list[tuple[str, int]]]:
    cls = FAMILIES.get(family)
    if family in DIRECTIONS:
        return DIRECTIONS[family]
    if cls is not None and hasattr(cls, "evolution_directions"):
        return dict(cls.evolution_directions)
    raise ValueError(f"family '{family}' has no evolution directions; add it to "
                     "apprentice.envs.evolve.DIRECTIONS or give the class an `evolution_directions` attribute")


def direction_scores(spec: ProblemSpec) -> dict[str, int]:
    """Steps from the easy end along each direction (sign-adjusted sum over its axes).

    ``spec.extra['harness']`` (a harness level for families without a harness axis) adds to harness."""
    cls = FAMILIES[spec.family]
    bounds = {ax.name: (ax.low, ax.high) for ax in cls.axes}
    out = {}
    for direction, axes in directions_of(spec.family).items():
        total = 0
        for axis, sign in axes:
            lo, hi = bounds[axis]
            v = int(spec.difficulty[axis])
            total += (v - lo) if sign > 0 else (hi - v)
        out[direction] = total
    out["harness"] = out.get("harness", 0) + int(spec.extra.get("harness", 0))
    return out


def hardness(spec: ProblemSpec) -> dict[str, int]:
    """The sign-adjusted difficulty vector: every component grows as the problem gets harder."""
    cls = FAMILIES[spec.family]
    signs = {a: s for axes in directions_of(spec.family).values() for a, s in axes}
    out = {}
    for ax in cls.axes:
        v = int(spec.difficulty[ax.name])
        out[ax.name] = (ax.high - v) if signs.get(ax.name, 1) < 0 else (v - ax.low)
    out["extra_harness"] = int(spec.extra.get("harness", 0))
    return out


def abilities_of(spec: ProblemSpec) -> set[str]:
    """AES ability tags: the family, each tool its oracle plan uses, and each non-trivial axis level."""
    env = FAMILIES[spec.family]()
    env.reset(spec=spec)
    tags = {f"family:{spec.family}"}
    tags |= {f"tool:{spec.family}.{c.name}" for c in env.oracle()}
    for name, v in hardness(spec).items():
        if v > 0:
            tags.add(f"{spec.family}:{name}>={v}")
    return tags


def solvable(spec: ProblemSpec) -> bool:
    """The oracle plan earns reward 1.0 through the public tools, within the turn budget."""
    cls = FAMILIES[spec.family]
    try:
        env = cls()
        env.reset(spec=spec)
        plan = env.oracle()
        return bool(plan) and len(plan) <= env.turn_budget() and replay(cls, spec, plan) == 1.0
    except (ValueError, RuntimeError, AssertionError):
        return False


def _solvable_near(spec: ProblemSpec, tries: int = 30) -> ProblemSpec | None:
    for attempt in range(tries):
        cand = spec if attempt == 0 else dataclasses.replace(spec, seed=derive_seed(spec.seed, "evolve", attempt))
        if solvable(cand):
            return cand
    return None


def evolve_spec(spec: ProblemSpec, direction: str) -> ProblemSpec | None:
    """One step harder along ``direction``; None when every axis of it is saturated or unsolvable."""
    if direction not in DIRECTION_NAMES:
        raise ValueError(f"unknown evolution direction '{direction}'; choose from {DIRECTION_NAMES}")
    cls = FAMILIES[spec.family]
    bounds = {ax.name: (ax.low, ax.high) for ax in cls.axes}
    for axis, sign in directions_of(spec.family).get(direction, []):
        v = int(spec.difficulty[axis]) + sign
        lo, hi = bounds[axis]
        if not lo <= v <= hi:
            continue
        extra = {**spec.extra, "parent": spec.problem_id, "operator": direction}
        cand = ProblemSpec(spec.family, spec.seed, {**spec.difficulty, axis: v}, spec.generation + 1, extra)
        found = _solvable_near(cand)
        if found is not None:
            return found
    return None


def evolve_generation(specs: Sequence[ProblemSpec], generation: int,
                      operators: Sequence[str] = DIRECTION_NAMES) -> list[tuple[ProblemSpec, str]]:
    """Generation g -> g+1: each problem tries ``operators[(h + g) % len]`` first (h from its id, so
    the direction does not line up with the family or row order), then the others in turn; over
    generations every problem is pushed along every direction. Saturated problems are dropped."""
    out = []
    for spec in specs:
        start = int(spec.problem_id[:8], 16) + generation
        for k in range(len(operators)):
            op = operators[(start + k) % len(operators)]
            new = evolve_spec(spec, op)
            if new is not None:
                out.append((new, op))
                break
    return out


def seed_generation(families: Sequence[str], n: int, seed: int) -> list[ProblemSpec]:
    """Generation 0: ``n`` easiest-level problems, split over the families."""
    out: list[ProblemSpec] = []
    for i in range(n):
        fam = families[i % len(families)]
        cls: Any = FAMILIES[fam]
        s = derive_seed(seed, "gen0", fam, i)
        spec = cls.generate(s, 0) if hasattr(cls, "generate") else \
            _solvable_near(cls.make_spec(s, cls.sample_difficulty(random.Random(s), 0)))
        if spec is None:
            raise RuntimeError(f"{fam}: no solvable level-0 problem near seed {s}")
        out.append(spec)
    return out


# ---- the fixed reference policy -----------------------------------------------------------------
_WORD = re.compile(r"[A-Za-z]+")


@functools.cache
def _signatures(cls: type[Environment]) -> list[tuple[str, list[tuple[str, type]], list[str]]]:
    """(tool, [(param, annotation)], words of its docstring) from signatures: cheaper than JSON
    schemas (no transformers import). Docstring words make plausible string arguments ("up")."""
    out = []
    for name in cls.tool_names():
        fn = getattr(cls, name)
        hints = typing.get_type_hints(fn)
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
        out.append((name, [(p, hints.get(p, str)) for p in params], _WORD.findall(inspect.getdoc(fn) or "")))
    return out


def _random_call(env: Environment, rng: random.Random, words: list[str]) -> ToolCall:
    name, params, doc_words = rng.choice(_signatures(type(env)))  # type: ignore[arg-type]
    args: dict[str, Any] = {}
    for p, ann in params:
        if ann is int:
            args[p] = rng.randint(1, 12)
        else:
            args[p] = rng.choice(words + doc_words) if words or doc_words else "x"
    return ToolCall(name, args)


def noisy_oracle_episode(spec: ProblemSpec, epsilon: float, rng: random.Random,
                         env_cls: type[Environment] | None = None) -> dict[str, Any]:
    """The oracle plan, open loop, slipping into a random tool call (random arguments) with probability
    ``epsilon`` before each step. Slips cost budget and may corrupt the state; nothing is learned.
    ``env_cls`` overrides the family's class (e.g. a deliberately broken one in flaw experiments)."""
    env = (env_cls or FAMILIES[spec.family])()
    task = env.reset(spec=spec)
    plan, budget = env.oracle(), env.turn_budget()
    words = _WORD.findall(task)
    turns = slips = i = 0
    while not env.done and turns < budget and i < len(plan):
        if rng.random() < epsilon:
            env.execute(_random_call(env, rng, words))
            slips += 1
        else:
            env.execute(plan[i])
            i += 1
        turns += 1
    return {"success": env.get_reward() >= 1.0, "turns": turns, "slips": slips, "plan_len": len(plan)}
