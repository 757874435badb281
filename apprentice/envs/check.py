"""``python -m apprentice check-env FAMILY``: does a family keep the environment protocol?

Why a checker: a new family (a plugin from ``envs.modules`` or an ``apprentice.envs`` entry point)
is trusted by every stage without review. This replays what the pipeline will do with it, across
levels and seeds, before any rollout: generation accepts only oracle-solvable specs, the spec
round-trips through JSON, the same spec rebuilds the same task and observations in a fresh instance
(determinism, third-party RNGs included), the oracle earns exactly 1.0 within the turn budget, a bad
call is an ``Error`` observation and never an exception, rewards stay in [0, 1], and the tool
schemas are what a strict OpenAI-compatible server accepts. Before any episode it checks the class
surface: at least one ``@tool``, every tool with typed arguments and a Google-style docstring
documenting each under ``Args:``, and no public method that is neither a tool nor a protocol method
(a forgotten ``@tool`` would otherwise be a method the model is never told about). After the episodes
it checks the level contract (:func:`monotone_problems`): a higher level is never easier. Prints one
line per check and the rendered schemas; returns the failures (empty = the family is usable).
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Sequence
from typing import Any

from apprentice.envs import resolve
from apprentice.envs.base import (
    _OPENAI_FUNCTION_KEYS,
    PROTOCOL_METHODS,
    Environment,
    ProblemSpec,
    ToolCall,
    is_tool,
)


def surface_problems(cls: type[Environment]) -> list[str]:
    """What is wrong with ``cls``'s methods as the protocol sees them: tools marked, typed and
    documented; no public method that is neither a tool nor a protocol method."""
    out = []
    tools = cls.tool_names()
    if not tools:
        out.append("no tools: mark the methods the agent may call with @tool (from apprentice.envs import tool)")
    for name, fn in inspect.getmembers(cls, predicate=inspect.isfunction):
        if name.startswith("_") or name in PROTOCOL_METHODS or is_tool(fn):
            continue
        out.append(f"public method '{name}' is neither a tool nor a protocol method "
                   f"({', '.join(sorted(PROTOCOL_METHODS))}): mark it with @tool or make it _private")
    for name in tools:
        fn = getattr(cls, name)
        params = [p for p in list(inspect.signature(fn).parameters.values())[1:]
                  if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        for p in params:
            if p.annotation is inspect.Parameter.empty:
                out.append(f"tool '{name}': argument '{p.name}' has no type annotation (e.g. '{p.name}: str')")
        doc = inspect.getdoc(fn) or ""
        if not doc.strip():
            out.append(f"tool '{name}': no docstring (Google style: a summary line, then 'Args:' with one "
                       "line per argument)")
            continue
        if params and not re.search(r"^Args:\s*$", doc, re.M):
            out.append(f"tool '{name}': the docstring has no 'Args:' section (Google style) documenting "
                       f"{', '.join(p.name for p in params)}")
            continue
        args = doc.split("Args:", 1)[1] if params else ""
        for p in params:
            if not re.search(rf"^\s+{re.escape(p.name)}\s*(\([^)]*\))?\s*:", args, re.M):
                out.append(f"tool '{name}': argument '{p.name}' is not documented under Args: "
                           f"(a line '{p.name}: what it is')")
    return out


def _schema_problems(schemas: list[dict[str, Any]]) -> list[str]:
    out = []
    for s in schemas:
        fn = s.get("function", {})
        name = fn.get("name", "?")
        if s.get("type") != "function" or not name:
            out.append(f"tool schema {s} is not {{'type': 'function', 'function': {{'name': ...}}}}")
        extra = sorted(set(fn) - set(_OPENAI_FUNCTION_KEYS))
        if extra:
            out.append(f"tool '{name}': non-standard keys {extra} (strict OpenAI-compatible servers reject them)")
        params = fn.get("parameters", {})
        if params.get("type") != "object":
            out.append(f"tool '{name}': parameters must be a JSON-schema object")
        if not fn.get("description"):
            out.append(f"tool '{name}': no description (give the method a docstring)")
        for arg, p in (params.get("properties") or {}).items():
            if not p.get("description"):
                out.append(f"tool '{name}': argument '{arg}' has no description (document it under Args:)")
    return out


#: an axis whose doc says this is one where a larger value is easier
_EASIER = re.compile(r"\b(more|higher|larger|bigger|greater)\b[^.;)]*\beasier\b", re.I)
#: the per-turn mistake rate of the reference agent that measures a level (see :func:`noisy_success`)
NOISE = 0.25
#: how much easier (in reference success) a level may measure than the level below before it fails
TOLERANCE = 0.05


def noisy_success(oracle_calls: int, budget: int, p: float = NOISE) -> float:
    """Chance that an agent which knows the solution but wastes each turn with probability ``p`` (a
    call that changes nothing) finishes the ``oracle_calls`` calls within ``budget`` turns: at most
    ``budget - oracle_calls`` wasted turns before the last needed call (negative binomial). It falls
    with a longer horizon and with fewer spare turns, the two things every family's levels trade,
    and needs no model: a cheap, deterministic yardstick for "higher level = harder"."""
    from math import comb

    spare = budget - oracle_calls
    if oracle_calls <= 0 or spare < 0:
        return 0.0 if spare < 0 else 1.0
    return sum(comb(oracle_calls - 1 + k, k) * p ** k for k in range(spare + 1)) * (1 - p) ** oracle_calls


def monotone_problems(cls: type[Environment], shape: dict[int, list[tuple[dict[str, int], int, int]]]) -> list[str]:
    """The level contract: level L+1 is no easier than level L. Two checks over the specs ``generate``
    made per level: an axis documented as easier when larger ("more is easier") must not grow with
    the level, and the reference agent of :func:`noisy_success` must not succeed more often at the
    higher level (by more than :data:`TOLERANCE`); e.g. a budget slack that rises with the level, or a
    step size that shortens the solution, fail here."""
    out: list[str] = []
    levels = sorted(lv for lv, rows in shape.items() if rows)
    mean_axis = {lv: {a.name: sum(d[a.name] for d, _, _ in shape[lv]) / len(shape[lv]) for a in cls.axes}
                 for lv in levels}
    for ax in cls.axes:
        if not _EASIER.search(ax.doc or ""):
            continue
        for lo, hi in zip(levels, levels[1:], strict=False):
            if mean_axis[hi][ax.name] > mean_axis[lo][ax.name]:
                out.append(f"level contract: axis '{ax.name}' is easier when larger ({ax.doc!r}) but grows from "
                           f"{mean_axis[lo][ax.name]:g} at level {lo} to {mean_axis[hi][ax.name]:g} at level {hi}; "
                           "a higher level must be harder: flip the axis (e.g. a budget *cut* instead of a slack, "
                           "so low + level is harder) or override sample_difficulty with a level table")
                break
    score = {lv: sum(noisy_success(n, b) for _, n, b in shape[lv]) / len(shape[lv]) for lv in levels}
    calls = {lv: sum(n for _, n, _ in shape[lv]) / len(shape[lv]) for lv in levels}
    spare = {lv: sum(b - n for _, n, b in shape[lv]) / len(shape[lv]) for lv in levels}
    for lo, hi in zip(levels, levels[1:], strict=False):
        if score[hi] > score[lo] + TOLERANCE:
            moved = [a for a in cls.axes if mean_axis[hi][a.name] != mean_axis[lo][a.name]]
            # the axes that broke it: one that falls with the level, or one documented "more is easier"
            # that grows; else every axis that moved
            broke = [a for a in moved if (mean_axis[hi][a.name] < mean_axis[lo][a.name]) != bool(_EASIER.search(a.doc or ""))]
            named = "; ".join(f"axis '{a.name}' {mean_axis[lo][a.name]:g} at level {lo} -> {mean_axis[hi][a.name]:g} at "
                              f"level {hi}" for a in (broke or moved)) or "no axis moved"
            out.append(f"level contract ({named}): level {hi} is easier than level {lo} (an agent erring on {NOISE:.0%} of its "
                       f"turns succeeds {score[hi]:.0%} vs {score[lo]:.0%}; oracle calls {calls[lo]:.1f} -> "
                       f"{calls[hi]:.1f}, spare turns {spare[lo]:.1f} -> {spare[hi]:.1f}): every axis is low + level, "
                       "so each must be harder when larger (a longer solution, fewer spare turns)")
    return out


def _play(cls: type, spec: ProblemSpec) -> tuple[str, list[str], float, bool, int, int]:
    """(task, observations, reward, done, oracle calls, turn budget) of the oracle in a fresh instance."""
    env = cls()
    task = env.reset(spec=spec)
    calls = env.oracle()
    budget = int(env.turn_budget())
    obs = []
    for c in calls:
        if env.done:
            break
        obs.append(env.execute(c))
    return task, obs, float(env.get_reward()), bool(env.done), len(calls), budget


def check_family(family: str, levels: Sequence[int] = (0, 1, 2), seeds: int = 3,
                 echo: Any = print) -> list[str]:
    """Run every check on ``family``; print progress with ``echo``; return the failures."""
    failures: list[str] = []

    def fail(msg: str) -> None:
        failures.append(msg)
        echo(f"  FAIL {msg}")

    try:
        cls = resolve(family)
    except (ValueError, ImportError) as e:
        fail(str(e))
        return failures
    echo(f"family {family}: {cls.__module__}.{cls.__qualname__}")
    if cls.family != family:
        fail(f"class attribute family = {cls.family!r}, registered as {family!r}")
    if not cls.axes:
        fail("no difficulty axes (class attribute axes)")
    surface = surface_problems(cls)
    for p in surface:
        fail(p)
    try:
        schemas = cls.tool_schemas()
    except Exception as e:  # noqa: BLE001 - transformers' schema builder rejects what it cannot render
        fail(f"the tool schemas cannot be built: {type(e).__name__}: {e}")
        schemas = []
    for p in _schema_problems(schemas):
        fail(p)
    if surface and not cls.tool_names():
        echo(f"{family}: {len(failures)} problem(s)")
        return failures
    from apprentice.envs.evolve import directions_of

    try:
        dirs = directions_of(family)
    except ValueError:
        dirs = None
    names = {a.name for a in cls.axes}
    for direction, moves in (dirs or {}).items():
        for axis, sign in moves:
            if axis not in names or sign not in (1, -1):
                fail(f"evolution direction '{direction}' moves ({axis!r}, {sign}): not an axis, or sign not +-1")
    echo(f"  axes: {', '.join(f'{a.name}[{a.low},{a.high}]' for a in cls.axes)}; "
         f"evolvable: {'yes ' + json.dumps(dirs) if dirs else 'no (no evolution_directions)'}")

    shape: dict[int, list[tuple[dict[str, int], int, int]]] = {}  # level -> (difficulty, oracle calls, budget)
    for level in levels:
        turns, ok = [], 0
        for seed in range(seeds):
            where = f"level {level} seed {seed}"
            try:
                spec = cls.generate(seed, level)
            except Exception as e:  # noqa: BLE001 - report any generator failure as a finding
                fail(f"{where}: generate raised {type(e).__name__}: {e}")
                continue
            if ProblemSpec.from_json(spec.to_json()) != spec or spec.family != family:
                fail(f"{where}: the spec does not round-trip through JSON")
                continue
            if cls.generate(seed, level).to_json() != spec.to_json():
                fail(f"{where}: generate is not deterministic (same seed, level -> different spec)")
            try:
                a, b = _play(cls, spec), _play(cls, spec)
            except Exception as e:  # noqa: BLE001
                fail(f"{where}: the oracle replay raised {type(e).__name__}: {e}")
                continue
            task, obs, reward, done, n_calls, budget = a
            if a != b:
                fail(f"{where}: two fresh instances of the same spec differ (task or observations): seed "
                     "third-party RNGs from the spec, not the global RNG")
            if not isinstance(task, str) or not task.strip():
                fail(f"{where}: reset returned no task text")
            if any(not isinstance(o, str) for o in obs):
                fail(f"{where}: a tool returned a non-string observation")
            if reward != 1.0:
                fail(f"{where}: the oracle earns {reward}, not 1.0")
            if n_calls > budget:
                fail(f"{where}: the oracle needs {n_calls} calls but the turn budget is {budget}")
            env = cls()
            env.reset(spec=spec)
            if not 0.0 <= env.get_reward() <= 1.0:
                fail(f"{where}: reward {env.get_reward()} before any call is outside [0, 1]")
            try:
                bad = env.execute(ToolCall("__no_such_tool__", {}))
                wrong = env.execute(ToolCall(cls.tool_names()[0], {"__bogus__": 1}))
            except Exception as e:  # noqa: BLE001
                fail(f"{where}: a bad call raised {type(e).__name__} instead of returning an Error observation")
            else:
                for what, o in (("an unknown tool", bad), ("unknown arguments", wrong)):
                    if not str(o).lstrip().startswith("Error"):
                        fail(f"{where}: {what} gives {str(o)[:60]!r}; error observations must start with 'Error'")
            turns.append(n_calls)
            shape.setdefault(level, []).append((dict(spec.difficulty), n_calls, budget))
            ok += 1
        mean = f"{sum(turns) / len(turns):.1f}" if turns else "-"
        echo(f"  level {level}: {ok}/{seeds} seeds pass, oracle turns {mean}")
    for p in monotone_problems(cls, shape):
        fail(p)
    echo("  tool schemas (what the model and an OpenAI-compatible server see):")
    for s in schemas:
        echo("    " + json.dumps(s, sort_keys=True))
    echo(f"{family}: {'OK' if not failures else f'{len(failures)} problem(s)'}")
    return failures


def level_shape(cls: type[Environment], levels: Sequence[int] = (0, 1, 2), seeds: int = 2
                ) -> dict[int, list[tuple[dict[str, int], int, int]]]:
    """Per level, (difficulty, oracle calls, turn budget) of the specs ``generate`` makes: what
    :func:`monotone_problems` judges. Builds each spec once and plays nothing, so it is cheap."""
    shape: dict[int, list[tuple[dict[str, int], int, int]]] = {}
    for level in levels:
        for seed in range(seeds):
            try:
                spec = cls.generate(seed, level)
                env = cls()
                env.reset(spec=spec)
                shape.setdefault(level, []).append((dict(spec.difficulty), len(env.oracle()), int(env.turn_budget())))
            except Exception:  # noqa: BLE001 - a family that cannot generate fails check-env itself
                continue
    return shape


_REFUSED: dict[str, list[str]] = {}


def require_level_contract(families: Sequence[str], allowed: Sequence[str] = ()) -> None:
    """Refuse to synthesize problems of a family whose levels break the level contract (the check
    ``check-env`` makes), naming the axis and the values that break it, unless the family is listed
    in ``allowed`` (``validate.allow_non_monotone``: the user's explicit override). Cached per family."""
    bad = []
    for family in families:
        cls = resolve(family)
        if cls.family in allowed or family in allowed:
            continue
        if cls.family not in _REFUSED:
            _REFUSED[cls.family] = monotone_problems(cls, level_shape(cls))
        bad += [f"{cls.family}: {p}" for p in _REFUSED[cls.family]]
    if bad:
        raise ValueError("check-env rejects these families (a higher level must never be easier):\n  "
                         + "\n  ".join(bad) + "\nfix the family, or list it in validate.allow_non_monotone "
                         "to use it anyway")
