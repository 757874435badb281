"""Data gates: Great Expectations suites from ``expectations/*.json`` run on pandas frames.

The only module that imports ``great_expectations`` (imported lazily: it costs ~3 s, and only the
validate and promote stages need it).

Design choices (measured, see shared/design/OPS-STACK-NOTES.md §6):

* An **ephemeral** GX context plus our own JSON loader: the suite files in ``expectations/`` are
  the single source of truth (GX's own ``to_json_dict`` format, ids stripped), nothing else on
  disk, identical in tests and production.
* Thresholds that come from params (truncation rate, success rate, the evaluation problem ids)
  are GX **suite parameters** (``{"$PARAMETER": "max_truncation_rate"}``) filled per run.
* Checks GX cannot express cheaply are **derived boolean columns** declared in the suite's
  ``meta.derived_columns`` and computed here: JSON-schema validity of the messages with a
  precompiled validator (GX's native JSON-schema expectation takes 8.6 s per 10k rows and errors
  out on one unparsable row), tool calls that name a declared tool with arguments matching its
  schema, and difficulty vectors inside their environment's axes. The suite then asserts
  ``column in [True]`` so the report counts and lists the offending rows like any expectation.
* The report is a small **self-contained HTML** page written here: GX Data Docs load bootstrap,
  jquery and font-awesome from CDNs and lose their pass/fail icons offline.
"""

from __future__ import annotations

import functools
import html
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from apprentice.paths import atomic_path

SUITES_DIR = Path(__file__).resolve().parent.parent / "expectations"

#: problem ids kept per failed expectation in the report (the count is always exact)
MAX_IDS = 200


class GateFailed(ValueError):
    """A gate found violations; ``str(e)`` lists every failed expectation (the CLI prints it)."""

    def __init__(self, message: str, results: Sequence[GateResult] = ()):
        super().__init__(message)
        self.results = list(results)


@dataclass
class Check:
    """One expectation's outcome, flattened for printing, the HTML report and MLflow."""

    expectation: str
    kwargs: dict[str, Any]
    success: bool
    observed: Any = None
    unexpected_count: int | None = None
    examples: list[Any] = field(default_factory=list)
    problem_ids: list[str] = field(default_factory=list)

    def line(self) -> str:
        what = ", ".join(f"{k}={_short(v)}" for k, v in self.kwargs.items())
        bits = []
        if self.observed is not None:
            bits.append(f"observed {_short(self.observed)}")
        if self.unexpected_count:
            bits.append(f"{self.unexpected_count} bad rows, e.g. {_short(self.examples)}")
        if self.problem_ids:
            bits.append(f"problem ids {_short(self.problem_ids, 400)}")
        status = "PASS" if self.success else "FAIL"
        return f"  {status} {self.expectation}({what})" + (f" -> {'; '.join(bits)}" if bits else "")


@dataclass
class GateResult:
    suite: str
    table: str
    rows: int
    checks: list[Check]

    @property
    def success(self) -> bool:
        return all(c.success for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.success]

    def summary(self) -> str:
        n_ok = sum(c.success for c in self.checks)
        head = (f"gate '{self.suite}' on {self.table} ({self.rows} rows): "
                f"{'passed' if self.success else 'FAILED'} ({n_ok}/{len(self.checks)} expectations)")
        return "\n".join([head, *(c.line() for c in self.failed)])

    def to_dict(self) -> dict[str, Any]:
        return {"suite": self.suite, "table": self.table, "rows": self.rows, "success": self.success,
                "checks": [c.__dict__ for c in self.checks]}


def _short(v: Any, n: int = 160) -> str:
    s = json.dumps(v, default=str) if not isinstance(v, str) else v
    return s if len(s) <= n else s[: n - 3] + "..."


# ---- derived columns ---------------------------------------------------------------------------

def _loads(s: Any) -> Any:
    return json.loads(s) if isinstance(s, str) else s


@functools.lru_cache(maxsize=256)
def _validator(schema_json: str) -> Any:
    import jsonschema

    schema = json.loads(schema_json)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema)


def _json_schema_ok(series: pd.Series, schema: Mapping[str, Any], row: pd.DataFrame) -> pd.Series:
    v = _validator(json.dumps(schema, sort_keys=True))

    def ok(s: Any) -> bool:
        try:
            return bool(v.is_valid(_loads(s)))
        except (ValueError, TypeError):
            return False

    return series.map(ok)


@functools.lru_cache(maxsize=64)
def _tool_validators(tools_json: str) -> dict[str, Any]:
    out = {}
    for t in json.loads(tools_json):
        fn = t.get("function", t)
        out[fn["name"]] = _validator(json.dumps(fn.get("parameters") or {"type": "object"}, sort_keys=True))
    return out


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


def _family_class(family: Any) -> Any:
    """The environment class of ``family`` (adapter and plugin families included), or None."""
    from apprentice.envs import FAMILIES

    if not isinstance(family, str):
        return None
    if family not in FAMILIES:
        try:
            from apprentice.envs import resolve

            return resolve(family)
        except (ValueError, ImportError):
            return None
    return FAMILIES[family]


def _calls_of(message: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """(name, arguments) of an assistant message's tool calls, arguments parsed from JSON strings."""
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        out.append((fn.get("name"), _loads(fn.get("arguments", {}))))
    return out


def replay_problem(spec_json: Any, messages: Any) -> tuple[bool, str]:
    """Replay an episode's tool calls in a fresh environment: (replayed success, first disagreement).

    The rollout engine's rules: calls run in order, none after the environment is done, a raising
    tool becomes an ``Error`` observation. The recorded tool observations must be the ones the
    environment gives now (same spec -> same bytes); the second element names the first that is not
    ("" when every observation matches)."""
    from apprentice.envs.base import ProblemSpec, ToolCall

    spec = ProblemSpec.from_json(spec_json)
    cls = _family_class(spec.family)
    if cls is None:
        return False, f"unknown environment family '{spec.family}'"
    env = cls()
    env.reset(spec=spec)
    msgs = list(_loads(messages))
    recorded = [str(m.get("content")) for m in msgs if m.get("role") == "tool"]
    replayed: list[str] = []
    for m in msgs:
        if m.get("role") != "assistant":
            continue
        for name, args in _calls_of(m):
            if env.done:
                break
            try:
                obs = env.execute(ToolCall(str(name), dict(args) if isinstance(args, dict) else {}))
            except Exception as e:  # noqa: BLE001 - the rollout engine turns a raising tool into an observation
                obs = f"Error: tool {name} failed: {type(e).__name__}: {e}"
            replayed.append(str(obs))
    diff = ""
    for i, (a, b) in enumerate(zip(recorded, replayed, strict=False)):
        if a != b:
            diff = f"tool observation {i + 1} differs from the environment's ({_short(a, 60)!r} vs {_short(b, 60)!r})"
            break
    if not diff and len(recorded) != len(replayed):
        diff = f"{len(recorded)} tool observations recorded, {len(replayed)} on replay"
    return env.get_reward() >= 1.0, diff


def _replay_ok(series: pd.Series, spec: Mapping[str, Any], df: pd.DataFrame) -> pd.Series:
    """The recorded ``success`` is what replaying the tool calls earns, and every observation matches."""
    def ok(messages: Any, spec_json: Any, success: Any) -> bool:
        try:
            won, diff = replay_problem(spec_json, messages)
        except (ValueError, TypeError, KeyError, AttributeError):
            return False
        return not diff and bool(won) == (success is True or success == 1)

    cols = zip(series, df[spec.get("spec_from", "spec")], df[spec.get("success_from", "success")], strict=True)
    return pd.Series([ok(*c) for c in cols], index=series.index)


def _message_lengths_ok(series: pd.Series, spec: Mapping[str, Any], df: pd.DataFrame) -> pd.Series:
    """Every message's content (and tool-call arguments) is at most ``max_chars`` characters."""
    cap = int(spec["max_chars"])

    def ok(messages: Any) -> bool:
        try:
            return all(_message_chars(m) <= cap for m in _loads(messages))
        except (ValueError, TypeError, AttributeError):
            return False

    return series.map(ok)


def _message_chars(m: Mapping[str, Any]) -> int:
    calls = m.get("tool_calls") or []
    return len(str(m.get("content") or "")) + sum(len(json.dumps(c, default=str)) for c in calls)


def _assistant_turns_ok(series: pd.Series, spec: Mapping[str, Any], df: pd.DataFrame) -> pd.Series:
    """Training-grade turns: every assistant turn makes a tool call and no format-error feedback
    (a user turn after the task) is in the transcript."""
    return series.map(lambda m: not _turn_problem(m))


def _turn_problem(messages: Any) -> str:
    try:
        msgs = list(_loads(messages))
    except (ValueError, TypeError):
        return "messages are not valid JSON"
    users = [i for i, m in enumerate(msgs) if m.get("role") == "user"]
    if len(users) > 1:
        return f"message {users[1] + 1} is format-error feedback (a malformed assistant turn before it)"
    for i, m in enumerate(msgs):
        if m.get("role") == "assistant" and not m.get("tool_calls"):
            what = "empty content" if not str(m.get("content") or "").strip() else "text"
            return f"assistant message {i + 1} has {what} and no tool call"
    return ""


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
        try:
            return ProblemSpec.from_json(spec_json).problem_id == pid
        except (ValueError, TypeError, KeyError, AttributeError):
            return False

    return pd.Series([ok(p, s) for p, s in zip(df[spec.get("id_from", "problem_id")], series, strict=True)],
                     index=series.index)


def _content_key(series: pd.Series, spec: Mapping[str, Any], df: pd.DataFrame) -> pd.Series:
    """Content key (normalised task text + oracle plan, :mod:`apprentice.dedupe`); the row's own id
    when the spec cannot be built (the spec check reports that row)."""
    from apprentice.dedupe import content_key

    def key(spec_json: Any, pid: Any) -> str:
        try:
            return content_key(str(spec_json))
        except Exception:  # noqa: BLE001 - an unbuildable spec fails its own expectation
            return f"unbuildable:{pid}"

    ids = df["problem_id"] if "problem_id" in df.columns else pd.Series(range(len(df)), index=df.index)
    return pd.Series([key(s, p) for s, p in zip(series, ids, strict=True)], index=series.index, dtype=object)


#: teacher columns the SFT selection reads
SFT_COLUMNS = ("problem_id", "sample_idx", "spec", "messages", "tools", "success", "truncated")


def _call_problem(messages: Any, tools: Any) -> str:
    """The first invalid tool call of a transcript (unknown tool, arguments not JSON or not fitting
    the tool's schema) or an ``Error`` observation, as a reason; "" when every call is valid."""
    try:
        validators = _tool_validators(tools if isinstance(tools, str) else json.dumps(tools))
        for i, m in enumerate(_loads(messages)):
            if m.get("role") == "tool" and str(m.get("content") or "").lstrip().startswith("Error"):
                return f"invalid tool call: message {i + 1} is an error observation ({_short(m.get('content'), 80)})"
            for call in m.get("tool_calls") or []:
                fn = call.get("function", call)
                try:
                    args = _loads(fn.get("arguments", {}))
                except ValueError:
                    return f"invalid tool call: message {i + 1} calls {fn.get('name')!r} with arguments that are not JSON"
                v = validators.get(fn.get("name"))
                if v is None:
                    return f"invalid tool call: message {i + 1} calls unknown tool {fn.get('name')!r}"
                if not isinstance(args, dict) or not v.is_valid(args):
                    return f"invalid tool call: message {i + 1} calls {fn.get('name')!r} with arguments off its schema"
        return ""
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        return f"invalid tool call: unreadable transcript ({type(e).__name__})"


def sft_exclusions(df: pd.DataFrame, success_only: bool, max_message_chars: int) -> list[str]:
    """Why each teacher episode is kept out of the SFT set ("" = kept), checked in this order:
    not a success, truncated, a malformed assistant turn, an invalid tool call or error observation,
    a message over ``max_message_chars``, and a replay in a fresh environment that disagrees with the
    recorded success or observations. Zero tolerance: SFT trains on every assistant token it keeps."""
    missing = [c for c in SFT_COLUMNS if c not in df.columns]
    if missing:
        return [f"teacher table lacks column {missing[0]!r}"] * len(df)
    out = []
    for row in df.itertuples(index=False):
        r = row._asdict()
        success = r["success"] is True or (not isinstance(r["success"], str) and r["success"] == 1)
        reason = ""
        if success_only and not success:
            reason = "not a success"
        elif not (r["truncated"] is False or r["truncated"] == 0):
            reason = "truncated"
        else:
            reason = _turn_problem(r["messages"])
            reason = f"malformed turn: {reason}" if reason else _call_problem(r["messages"], r["tools"])
        if not reason:
            try:
                too_long = [i for i, m in enumerate(_loads(r["messages"])) if _message_chars(m) > max_message_chars]
            except (ValueError, TypeError, AttributeError):
                too_long = [0]
            if too_long:
                reason = f"message too long: message {too_long[0] + 1} exceeds {max_message_chars} characters"
        if not reason:
            try:
                won, diff = replay_problem(r["spec"], r["messages"])
                if diff or won != success:
                    reason = f"replay disagrees: {diff or f'replaying the calls earns success={won}'}"
            except (ValueError, TypeError, KeyError, AttributeError) as e:
                reason = f"replay disagrees: the episode cannot be replayed ({type(e).__name__}: {e})"
        out.append(reason)
    return out


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
}

#: derived checks whose column is a value (compared across rows/tables), not a pass/fail flag
VALUE_CHECKS = {"content_key"}

#: columns each derived check reads besides ``from`` (a missing one fails the check, not the stage)
_READS = ("tools_from", "family_from", "spec_from", "success_from", "id_from")
_DEFAULT_READS = {"tool_calls": {"tools_from": "tools"}, "valid_calls": {"tools_from": "tools"}, "difficulty": {"family_from": "family"},
                  "replay": {"spec_from": "spec", "success_from": "success"}, "spec_id": {"id_from": "problem_id"}}


def add_derived(df: pd.DataFrame, meta: Mapping[str, Any], params: Mapping[str, Any] | None = None) -> pd.DataFrame:
    """``df`` plus the suite's derived columns; ``{"$PARAMETER": name}`` in a column's spec reads ``params``."""
    out = df.copy()
    params = params or {}
    for col, raw in meta.get("derived_columns", {}).items():
        spec = {k: params[v["$PARAMETER"]] if isinstance(v, dict) and "$PARAMETER" in v else v
                for k, v in raw.items()}
        spec = {**_DEFAULT_READS.get(spec["check"], {}), **spec}
        needed = [spec["from"], *(spec[k] for k in _READS if k in spec)]
        if any(c not in out.columns for c in needed):  # the column expectations name the missing column
            out[col] = None if spec["check"] in VALUE_CHECKS else False
            continue
        values = DERIVED[spec["check"]](out[spec["from"]], spec, out)
        out[col] = values if spec["check"] in VALUE_CHECKS else values.astype(bool)
    return out


# ---- GX ----------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _batch_definition() -> Any:
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    ctx = gx.get_context(mode="ephemeral")
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
    asset = ctx.data_sources.add_pandas("frames").add_dataframe_asset("frame")
    return ctx, asset.add_batch_definition_whole_dataframe("whole")


def load_suite(name: str, suites_dir: Path = SUITES_DIR) -> dict[str, Any]:
    path = Path(suites_dir) / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"expectation suite {path} not found; suites: "
                                f"{sorted(p.stem for p in Path(suites_dir).glob('*.json'))}")
    return json.loads(path.read_text())


def check(df: pd.DataFrame, suite: str, params: Mapping[str, Any] | None = None, table: str = "",
          suites_dir: Path = SUITES_DIR) -> GateResult:
    """Validate ``df`` against suite ``suite`` (``expectations/<suite>.json``); never raises on violations."""
    import great_expectations as gx

    spec = load_suite(suite, suites_dir)
    ctx, batch_def = _batch_definition()
    if spec["name"] in {s.name for s in ctx.suites.all()}:
        ctx.suites.delete(spec["name"])  # the file is the source of truth, reload every call
    gx_suite = ctx.suites.add(gx.ExpectationSuite(name=spec["name"], expectations=spec["expectations"],
                                                  meta=spec.get("meta", {})))
    frame = add_derived(df, spec.get("meta", {}), params)
    fmt: dict[str, Any] = {"result_format": "COMPLETE", "partial_unexpected_count": 5}
    if "problem_id" in frame.columns:  # every failed row expectation lists the problem ids it failed on
        fmt["unexpected_index_column_names"] = ["problem_id"]
    result = batch_def.get_batch(batch_parameters={"dataframe": frame}).validate(
        gx_suite, expectation_parameters=dict(params or {}), result_format=fmt)
    res = json.loads(json.dumps(result.to_json_dict(), default=str))  # numpy scalars -> plain JSON
    checks = []
    for r in res["results"]:
        cfg, out = r["expectation_config"], r.get("result") or {}
        kwargs = {k: v for k, v in cfg["kwargs"].items() if k != "batch_id"}
        if isinstance(kwargs.get("value_set"), list) and len(kwargs["value_set"]) > 8:
            kwargs["value_set"] = f"<{len(kwargs['value_set'])} values>"
        ids = [str(x.get("problem_id")) for x in out.get("unexpected_index_list") or [] if isinstance(x, dict)]
        checks.append(Check(cfg["type"], kwargs, bool(r["success"]), out.get("observed_value"),
                            out.get("unexpected_count"), (out.get("partial_unexpected_list") or [])[:5],
                            list(dict.fromkeys(ids))[:MAX_IDS]))
        if r.get("exception_info", {}).get("raised_exception"):
            checks[-1].observed = r["exception_info"].get("exception_message")
    return GateResult(spec["name"], table or suite, len(df), checks)


# ---- reports -----------------------------------------------------------------------------------

_CSS = """body{font:14px system-ui,sans-serif;margin:2em;color:#222}h1{font-size:20px}
h2{font-size:16px;margin-top:1.6em}table{border-collapse:collapse;width:100%}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3}.PASS{color:#fff;background:#2e7d32;font-weight:bold}
.FAIL{color:#fff;background:#c62828;font-weight:bold}code{font-size:12px;word-break:break-all}"""


def render_html(results: Sequence[GateResult], title: str, excluded: Sequence[Mapping[str, Any]] = ()) -> str:
    """A single self-contained page (inline CSS, no scripts, no external resources)."""
    ok = all(r.success for r in results)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}: "
             f"<span class='{'PASS' if ok else 'FAIL'}'>&nbsp;{'PASSED' if ok else 'FAILED'}&nbsp;</span></h1>"]
    for r in results:
        n_ok = sum(c.success for c in r.checks)
        parts.append(f"<h2>{html.escape(r.suite)} on <code>{html.escape(r.table)}</code> ({r.rows} rows): "
                     f"{n_ok}/{len(r.checks)} passed</h2><table><tr><th>status</th><th>expectation</th>"
                     "<th>arguments</th><th>observed</th><th>bad rows (examples)</th><th>problem ids</th></tr>")
        for c in sorted(r.checks, key=lambda c: c.success):
            status = "PASS" if c.success else "FAIL"
            bad = "" if not c.unexpected_count else f"{c.unexpected_count}: {_short(c.examples, 300)}"
            parts.append(f"<tr><td class='{status}'>{status}</td><td>{html.escape(c.expectation)}</td>"
                         f"<td><code>{html.escape(_short(c.kwargs, 400))}</code></td>"
                         f"<td><code>{html.escape('' if c.observed is None else _short(c.observed))}</code></td>"
                         f"<td><code>{html.escape(bad)}</code></td>"
                         f"<td><code>{html.escape(' '.join(c.problem_ids))}</code></td></tr>")
        parts.append("</table>")
    if excluded:
        counts = reason_counts(excluded)
        parts.append(f"<h2>Episodes excluded from the SFT set: {len(excluded)}</h2><p>"
                     + "; ".join(f"{html.escape(k)}: {v}" for k, v in counts.items())
                     + "</p><table><tr><th>problem id</th><th>sample</th><th>reason</th></tr>")
        parts.extend(f"<tr><td><code>{html.escape(str(e.get('problem_id')))}</code></td>"
                     f"<td>{html.escape(str(e.get('sample_idx')))}</td><td>{html.escape(str(e.get('reason')))}</td></tr>"
                     for e in excluded)
        parts.append("</table>")
    parts.append("</body></html>")
    return "\n".join(parts)


def reason_counts(excluded: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Excluded episodes per reason kind (the text before the first ':')."""
    counts: dict[str, int] = {}
    for e in excluded:
        kind = str(e.get("reason", "")).split(":")[0]
        counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def write_reports(results: Sequence[GateResult], html_path: Path, json_path: Path, title: str,
                  excluded: Sequence[Mapping[str, Any]] = (), sft_path: Path | None = None) -> None:
    """Write the HTML page and a JSON summary (DVC metrics) atomically.

    ``excluded`` lists the episodes kept out of the SFT set, each with its reason. ``sft_path`` (only
    when the gate passed and the SFT set is written) records that file's SHA-256: the gate record
    :func:`require_passed` checks before anything trains on it."""
    passed = all(r.success for r in results)
    with atomic_path(Path(html_path)) as tmp:
        tmp.write_text(render_html(results, title, excluded))
    summary = {"passed": passed,
               "expectations": sum(len(r.checks) for r in results),
               "failed": sum(len(r.failed) for r in results),
               "sft_excluded": len(excluded),
               "sft_excluded_by_reason": reason_counts(excluded),
               "suites": {f"{r.suite}:{r.table}": r.to_dict() for r in results},
               "excluded_episodes": list(excluded)}
    if passed and sft_path is not None:
        summary["sft_sha256"] = _file_sha256(Path(sft_path))
    with atomic_path(Path(json_path)) as tmp:
        tmp.write_text(json.dumps(summary, indent=1, default=str))


def _file_sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def require_passed(data_path: Path, record_path: Path) -> None:
    """Raise :class:`GateFailed` unless ``record_path`` (``gate.json``) records a passed gate for exactly
    the bytes of ``data_path`` (the SFT set): training never reads data the gate did not pass."""
    data_path, record_path = Path(data_path), Path(record_path)
    fix = "run `python -m apprentice validate` and fix what its report lists"
    if not record_path.exists():
        raise GateFailed(f"{data_path} has no gate record ({record_path} is missing); {fix}")
    try:
        record = json.loads(record_path.read_text())
    except json.JSONDecodeError as e:
        raise GateFailed(f"gate record {record_path} is unreadable ({e}); {fix}") from None
    if record.get("passed") is not True:
        raise GateFailed(f"the data gate FAILED ({record_path}, {record.get('failed')} failed expectations): "
                         f"{data_path} is not trained on; {fix}")
    if not data_path.exists():
        raise FileNotFoundError(f"{data_path} does not exist; {fix}")
    if record.get("sft_sha256") != _file_sha256(data_path):
        raise GateFailed(f"{data_path} is not the file the gate passed (SHA-256 differs from {record_path}); "
                         f"it was changed after validation; {fix}")


def raise_if_failed(results: Sequence[GateResult], report: Path | None = None) -> None:
    failed = [r for r in results if not r.success]
    if failed:
        where = f"\nfull report: {report}" if report else ""
        raise GateFailed("data gate failed; nothing downstream runs until the data is fixed:\n"
                         + "\n".join(r.summary() for r in failed) + where, results)
