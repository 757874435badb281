"""Derived columns: the checks GX cannot express cheaply, computed per row so a suite can assert them.

A suite declares them in ``meta.derived_columns`` (each names a check of :data:`DERIVED` and the
columns it reads); :func:`add_derived` adds them to the frame before GX validates it, and the suite
asserts ``column in [True]``, so the report counts and lists offending rows like any expectation.
Two checks (:data:`VALUE_CHECKS`) yield a key instead of a flag, for uniqueness and overlap
expectations across rows and tables. JSON-schema validity runs on a precompiled validator because
GX's native JSON-schema expectation is slow and errors out on one unparsable row. The episode
checks read the audit of :mod:`apprentice.gate.audit`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import pandas as pd

from apprentice.gate.audit import (
    _call_problem,
    _episode_findings,
    _family_class,
    _loads,
    _message_chars,
    _tool_validators,
    _turn_problem,
    _validator,
    rollout_failed,
    spec_problem,
)


def _json_schema_ok(series: pd.Series, schema: Mapping[str, Any], row: pd.DataFrame) -> pd.Series:
    v = _validator(json.dumps(schema, sort_keys=True))

    def ok(s: Any) -> bool:
        try:
            return bool(v.is_valid(_loads(s)))
        except (ValueError, TypeError):
            return False

    return series.map(ok)


def _tool_calls_ok(series: pd.Series, spec: Mapping[str, Any], df: pd.DataFrame) -> pd.Series:
    """Every assistant tool call names a tool in the row's ``tools`` and its arguments fit its schema."""
    tools_col = spec.get("tools_from", "tools")

    def ok(messages: Any, tools: Any) -> bool:
        try:
            validators = _tool_validators(tools if isinstance(tools, str) else json.dumps(tools))
            for m in _loads(messages):
                for call in m.get("tool_calls") or []:
                    fn = call.get("function", call)
                    args = _loads(fn.get("arguments", {}))
                    v = validators.get(fn.get("name"))
                    if v is None or not isinstance(args, dict) or not v.is_valid(args):
                        return False
            return True
        except (ValueError, TypeError, KeyError, AttributeError):
            return False

    return pd.Series([ok(m, t) for m, t in zip(series, df[tools_col], strict=True)], index=series.index)


def _difficulty_ok(series: pd.Series, spec: Mapping[str, Any], df: pd.DataFrame) -> pd.Series:
    """The difficulty vector has exactly the family's axes, each inside [low, high]."""
    def ok(diff: Any, family: Any) -> bool:
        env = _family_class(family)
        try:
            d = _loads(diff)
        except (ValueError, TypeError):
            return False
        if env is None or not isinstance(d, dict) or set(d) != {ax.name for ax in env.axes}:
            return False
        try:  # NaN, None, strings: not a difficulty (int(nan) would raise, naming nothing)
            return all(float(d[ax.name]).is_integer() and ax.low <= int(d[ax.name]) <= ax.high for ax in env.axes)
        except (TypeError, ValueError, OverflowError):
            return False

    return pd.Series([ok(d, f) for d, f in zip(series, df[spec.get("family_from", "family")], strict=True)],
                     index=series.index)


def _calls_of(message: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """(name, arguments) of an assistant message's tool calls, arguments parsed from JSON strings."""
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        out.append((fn.get("name"), _loads(fn.get("arguments", {}))))
    return out


def _episode_ok(series: pd.Series, spec: Mapping[str, Any], df: pd.DataFrame) -> pd.Series:
    """No :data:`EPISODE_CHECKS` finding of kind ``spec["audit"]`` (one name or a list)."""
    wanted = [spec["audit"]] if isinstance(spec["audit"], str) else list(spec["audit"])
    found = _episode_findings(df, spec)
    return pd.Series([not any(f[w] for w in wanted) for f in found], index=series.index)


def _replay_ok(series: pd.Series, spec: Mapping[str, Any], df: pd.DataFrame) -> pd.Series:
    """The recorded ``success`` and every tool observation are what a fresh environment gives (a
    transcript that cannot be replayed to its end, for its spec, messages or protocol, counts as not
    replayed)."""
    return _episode_ok(series, {**spec, "audit": ["replay", "spec", "env_messages", "protocol"]}, df)


def _spec_valid_ok(series: pd.Series, spec: Mapping[str, Any], df: pd.DataFrame) -> pd.Series:
    """The spec is one its environment accepts (:func:`spec_problem`) and agrees with the row's
    ``family``, ``seed`` and ``difficulty`` columns (where the table has them)."""
    def col(name: str) -> Any:
        return df[name] if name in df.columns else [None] * len(df)

    def ok(spec_json: Any, family: Any, seed: Any, difficulty: Any) -> bool:
        if spec_problem(spec_json):
            return False
        d = _loads(spec_json)
        try:
            if family is not None and family != d["family"]:
                return False
            if seed is not None and float(seed) != float(d["seed"]):
                return False
            if difficulty is not None:
                diff = {str(k): float(v) for k, v in dict(_loads(difficulty)).items()}
                return diff == {str(k): float(v) for k, v in d["difficulty"].items()}
        except (ValueError, TypeError, KeyError):
            return False
        return True

    rows = zip(series, col("family"), col("seed"), col("difficulty"), strict=True)
    return pd.Series([ok(*r) for r in rows], index=series.index)


def _task_key(series: pd.Series, spec: Mapping[str, Any], df: pd.DataFrame) -> pd.Series:
    """The task text reduced to its words (:func:`apprentice.data.dedupe.task_key`): rendered from the
    spec, or (``"source": "transcript"``) the first user turn as recorded."""
    from apprentice.data.dedupe import spec_task_key, task_key

    def key(v: Any, i: Any) -> str:
        try:
            if spec.get("source") == "transcript":
                msgs = _loads(v)
                return task_key(next(str(m.get("content")) for m in msgs if m.get("role") == "user"))
            if spec_problem(v):
                return f"unbuildable:{i}"
            from apprentice.envs.base import ProblemSpec

            return spec_task_key(ProblemSpec.from_json(v))
        except Exception:  # noqa: BLE001 - an unbuildable spec or transcript fails its own expectation
            return f"unbuildable:{i}"

    return pd.Series([key(v, i) for i, v in zip(series.index, series, strict=True)], index=series.index, dtype=object)


def _message_lengths_ok(series: pd.Series, spec: Mapping[str, Any], df: pd.DataFrame) -> pd.Series:
    """Every message's content (and tool-call arguments) is at most ``max_chars`` characters.

    ``"skip_roles": ["assistant"]`` leaves those roles' messages out: a runaway generation is
    something an honest teacher produces, so the teacher table tolerates it and the SFT selection
    excludes and names that episode, while an over-long task or observation still fails."""
    cap = int(spec["max_chars"])
    skip = set(spec.get("skip_roles") or ())

    def ok(messages: Any) -> bool:
        try:
            return all(_message_chars(m) <= cap for m in _loads(messages) if m.get("role") not in skip)
        except (ValueError, TypeError, AttributeError):
            return False

    return series.map(ok)


def _assistant_turns_ok(series: pd.Series, spec: Mapping[str, Any], df: pd.DataFrame) -> pd.Series:
    """Training-grade turns: every assistant turn makes a tool call and no format-error feedback
    (a user turn after the task) is in the transcript."""
    return series.map(lambda m: not _turn_problem(m))


def _transcript_ok(series: pd.Series, spec: Mapping[str, Any], df: pd.DataFrame) -> pd.Series:
    """As the rollout engine records it: an assistant turn without a tool call is a parse error, so
    format-error feedback (a user turn) follows it, unless it is the transcript's last message."""
    def ok(messages: Any) -> bool:
        try:
            msgs = list(_loads(messages))
            return all(m.get("tool_calls") or i == len(msgs) - 1 or msgs[i + 1].get("role") == "user"
                       for i, m in enumerate(msgs) if m.get("role") == "assistant")
        except (ValueError, TypeError, AttributeError):
            return False

    return series.map(ok)


def _spec_id_ok(series: pd.Series, spec: Mapping[str, Any], df: pd.DataFrame) -> pd.Series:
    """``problem_id`` is the content hash of the row's spec (a copied row under a new id is caught)."""
    from apprentice.envs.base import ProblemSpec

    def ok(pid: Any, spec_json: Any) -> bool:
        if spec_problem(spec_json):  # Infinity seed, axis out of range: not a spec, never an exception
            return False
        return ProblemSpec.from_json(spec_json).problem_id == pid

    return pd.Series([ok(p, s) for p, s in zip(df[spec.get("id_from", "problem_id")], series, strict=True)],
                     index=series.index)


def _content_key(series: pd.Series, spec: Mapping[str, Any], df: pd.DataFrame) -> pd.Series:
    """Content key (normalised task text + oracle plan, :mod:`apprentice.data.dedupe`); the row's own id
    when the spec cannot be built (the spec check reports that row)."""
    from apprentice.data.dedupe import content_key

    def key(spec_json: Any, pid: Any) -> str:
        if spec_problem(spec_json):
            return f"unbuildable:{pid}"
        try:
            return content_key(str(spec_json))
        except Exception:  # noqa: BLE001 - an unbuildable spec fails its own expectation
            return f"unbuildable:{pid}"

    ids = df["problem_id"] if "problem_id" in df.columns else pd.Series(range(len(df)), index=df.index)
    return pd.Series([key(s, p) for s, p in zip(series, ids, strict=True)], index=series.index, dtype=object)


def tool_calls_valid(df: pd.DataFrame) -> pd.Series:
    """Per-row: every tool call is well-formed (used to filter the SFT set)."""
    if df.empty:
        return pd.Series([], dtype=bool, index=df.index)
    return _tool_calls_ok(df["messages"], {}, df).astype(bool)


DERIVED: dict[str, Callable[[pd.Series, Mapping[str, Any], pd.DataFrame], pd.Series]] = {
    "json_schema": lambda s, spec, df: _json_schema_ok(s, spec["json_schema"], df),
    "tool_calls": _tool_calls_ok,
    "difficulty": _difficulty_ok,
    "replay": _replay_ok,
    "valid_calls": lambda s, spec, df: pd.Series(
        [not _call_problem(m, t) for m, t in zip(s, df[spec["tools_from"]], strict=True)], index=s.index),
    "message_lengths": _message_lengths_ok,
    "assistant_turns": _assistant_turns_ok,
    "spec_id": _spec_id_ok,
    "transcript": _transcript_ok,
    "content_key": _content_key,
    "episode": _episode_ok,
    "spec_valid": _spec_valid_ok,
    "task_key": _task_key,
    "rollout_failed": lambda s, spec, df: rollout_failed(df),
}

#: derived checks whose column is a value (compared across rows/tables), not a pass/fail flag
VALUE_CHECKS = {"content_key", "task_key"}

#: columns each derived check reads besides ``from`` (a missing one fails the check, not the stage)
_READS = ("tools_from", "family_from", "spec_from", "success_from", "id_from")
_DEFAULT_READS = {"tool_calls": {"tools_from": "tools"}, "valid_calls": {"tools_from": "tools"}, "difficulty": {"family_from": "family"},
                  "replay": {"spec_from": "spec", "success_from": "success"}, "spec_id": {"id_from": "problem_id"}}


def add_derived(df: pd.DataFrame, meta: Mapping[str, Any], params: Mapping[str, Any] | None = None) -> pd.DataFrame:
    """``df`` plus the suite's derived columns; ``{"$PARAMETER": name}`` in a column's spec reads ``params``."""
    out = df.copy()
    params = params or {}
    # rows the rollout marked failed hold no episode: every row check passes them (the rollout_failed
    # column and the SFT exclusion list name them), so one accepted failure does not fail the gate
    skip = rollout_failed(out) if meta.get("pass_rollout_failed") else pd.Series(False, index=out.index)
    for col, raw in meta.get("derived_columns", {}).items():
        spec = {k: params[v["$PARAMETER"]] if isinstance(v, dict) and "$PARAMETER" in v else v
                for k, v in raw.items()}
        spec = {**_DEFAULT_READS.get(spec["check"], {}), **spec}
        needed = [spec["from"], *(spec[k] for k in _READS if k in spec)]
        if any(c not in out.columns for c in needed):  # the column expectations name the missing column
            out[col] = None if spec["check"] in VALUE_CHECKS else False
            continue
        values = DERIVED[spec["check"]](out[spec["from"]], spec, out)
        if spec["check"] in VALUE_CHECKS:
            out[col] = values
        else:
            out[col] = values.astype(bool) | (skip if spec["check"] != "rollout_failed" else False)
    return out
