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
(a forgotten ``@tool`` would otherwise be a method the model is never told about). Prints one line per
check and the rendered schemas; returns the failures (empty = the family is usable).
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
            ok += 1
        mean = f"{sum(turns) / len(turns):.1f}" if turns else "-"
        echo(f"  level {level}: {ok}/{seeds} seeds pass, oracle turns {mean}")
    echo("  tool schemas (what the model and an OpenAI-compatible server see):")
    for s in schemas:
        echo("    " + json.dumps(s, sort_keys=True))
    echo(f"{family}: {'OK' if not failures else f'{len(failures)} problem(s)'}")
    return failures
