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
import math
import re
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
    #: the failing rows as "problem id / sample k" (tables with a ``sample_idx``)
    episodes: list[str] = field(default_factory=list)

    def line(self) -> str:
        what = ", ".join(f"{k}={_short(v)}" for k, v in self.kwargs.items())
        bits = []
        if self.observed is not None:
            bits.append(f"observed {_short(self.observed)}")
        if self.unexpected_count:
            bits.append(f"{self.unexpected_count} bad rows, e.g. {_short(self.examples)}")
        if self.episodes:
            bits.append(f"episodes {_short(self.episodes, 600)}")
        elif self.problem_ids:
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


def episode_name(problem_id: Any, sample_idx: Any) -> str:
    """How the report names one episode: ``<problem id>/sample <k>``."""
    k = sample_idx.item() if hasattr(sample_idx, "item") else sample_idx
    return f"{problem_id}/sample {k}"


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


def _episode_findings(df: pd.DataFrame, spec: Mapping[str, Any]) -> list[dict[str, str]]:
    """:func:`audit_episode` of every row (columns named by ``spec``; a missing optional one is skipped)."""
    def col(key: str, default: str) -> Any:
        name = spec.get(key, default)
        return df[name] if name in df.columns else pd.Series([None] * len(df), index=df.index)

    cols = [col("spec_from", "spec"), col("from", "messages"), col("tools_from", "tools"),
            col("success_from", "success"), col("reward_from", "reward"), col("family_from", "family"),
            col("difficulty_from", "difficulty")]
    return [audit_episode(*row) for row in zip(*cols, strict=True)]


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


def rollout_failed(df: pd.DataFrame) -> pd.Series:
    """Rows the rollout recorded as failed after its retries (``extra.error``, accepted under
    ``rollout.error_budget``): they carry no episode, so the gate excludes and names them."""
    def failed(extra: Any) -> bool:
        try:
            e = _loads(extra)
        except (ValueError, TypeError):
            return False
        return isinstance(e, Mapping) and bool(e.get("error"))

    if "extra" not in df.columns:
        return pd.Series(False, index=df.index)
    return df["extra"].map(failed).astype(bool)


def _rollout_error(extra: Any) -> str:
    try:
        return str(_loads(extra).get("error"))
    except (ValueError, TypeError, AttributeError):
        return ""


def _task_key(series: pd.Series, spec: Mapping[str, Any], df: pd.DataFrame) -> pd.Series:
    """The task text reduced to its words (:func:`apprentice.dedupe.task_key`): rendered from the
    spec, or (``"source": "transcript"``) the first user turn as recorded."""
    from apprentice.dedupe import spec_task_key, task_key

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
        if spec_problem(spec_json):  # Infinity seed, axis out of range: not a spec, never an exception
            return False
        return ProblemSpec.from_json(spec_json).problem_id == pid

    return pd.Series([ok(p, s) for p, s in zip(df[spec.get("id_from", "problem_id")], series, strict=True)],
                     index=series.index)


def _content_key(series: pd.Series, spec: Mapping[str, Any], df: pd.DataFrame) -> pd.Series:
    """Content key (normalised task text + oracle plan, :mod:`apprentice.dedupe`); the row's own id
    when the spec cannot be built (the spec check reports that row)."""
    from apprentice.dedupe import content_key

    def key(spec_json: Any, pid: Any) -> str:
        if spec_problem(spec_json):
            return f"unbuildable:{pid}"
        try:
            return content_key(str(spec_json))
        except Exception:  # noqa: BLE001 - an unbuildable spec fails its own expectation
            return f"unbuildable:{pid}"

    ids = df["problem_id"] if "problem_id" in df.columns else pd.Series(range(len(df)), index=df.index)
    return pd.Series([key(s, p) for s, p in zip(series, ids, strict=True)], index=series.index, dtype=object)


# ---- episode audit: every way a transcript can lie ----------------------------------------------
#
# Why hand-written: no validation library knows what the rollout engine records. The audit walks a
# transcript the way the engine wrote it, in a fresh environment reset on the row's spec, and
# compares every message the environment produced (system prompt, task, format feedback, tool
# observations) with what it produces now; it checks the call/result protocol, asks the environment
# whether each call was possible given only what the agent had seen (``Environment.ungrounded``),
# and scans every string for text no honest rollout records. One walk per episode (cached: each
# check's derived column reads the same result), every finding a sentence naming the message.

#: check -> (effect, what it asserts). "fail": no honest rollout records it (the data lies, or lies
#: outside what the config allows): the trajectories suite fails, naming the episode. "exclude": an
#: honest teacher can produce it (a model's garbage, a guess, a multi-call turn cut at the end): the
#: episode is kept out of the SFT set and listed with its reason; the gate still passes.
EPISODE_CHECKS: dict[str, tuple[str, str]] = {
    "spec": ("fail", "the spec is one its environment accepts (known family, finite integer seed, every "
                     "difficulty axis in range) and matches the row's family and difficulty"),
    "env_messages": ("fail", "system prompt, task text and format feedback are what the environment renders"),
    "protocol": ("fail", "each tool call answered by exactly one result, in order, with its name and call id; "
                         "no call before the previous result; nothing after the episode ended"),
    "replay": ("fail", "every tool observation and the recorded success are what the environment gives"),
    "reward": ("fail", "the reward is the replayed reward, and success is exactly reward 1.0"),
    "after_end": ("exclude", "no call of the last turn is left without a result because the episode had ended"),
    "grounding": ("exclude", "every call uses only what earlier observations showed (the environment judges)"),
    "privileged": ("exclude", "no assistant turn states the oracle plan or a hidden answer before it was shown"),
    "hygiene": ("exclude", "no control character, ANSI escape, NUL, lone surrogate or mojibake in any message"),
}

#: C0/C1 controls but tab, newline, carriage return; DEL; bidi overrides; zero-width and BOM;
#: the replacement character and non-characters; surrogates (a JSON "\ud83d" alone decodes to one)
_BAD_CHAR = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b\u202a-\u202e\u2066-\u2069\ufeff\ufffd\ufffe\uffff"
                       "\ud800-\udfff]")
_ANSI = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)|[@-Z\\-_])")
#: runs of characters that UTF-8 bytes become when decoded as cp1252 / Latin-1
_MOJI_RUN = re.compile("[\u0080-\u00ff\u0152\u0153\u0160\u0161\u0178\u017d\u017e\u0192\u02c6\u02dc\u2013\u2014"
                       "\u2018-\u201e\u2020-\u2022\u2026\u2030\u2039\u203a\u20ac\u2122]{2,}")
_UTF8_SEQ = re.compile(rb"[\xc2-\xdf][\x80-\xbf]|[\xe0-\xef][\x80-\xbf]{2}|[\xf0-\xf4][\x80-\xbf]{3}")


def _cp1252_bytes(run: str) -> bytes:
    out = bytearray()
    for ch in run:
        try:
            out += ch.encode("cp1252")
        except UnicodeEncodeError:
            out += ch.encode("latin-1") if ord(ch) < 256 else b"?"
    return bytes(out)


def text_problem(s: str) -> str:
    """What is wrong with ``s`` as training text ("" = clean): a NUL, an ANSI escape, another control
    character, a lone surrogate, a replacement character, or mojibake (UTF-8 read as cp1252)."""
    if "\x00" in s:
        return "a NUL character"
    if "\x1b" in s:
        m = _ANSI.search(s)
        return f"an ANSI escape {m.group()!r}" if m else "an escape character (U+001B)"
    for run in _MOJI_RUN.findall(s):
        if _UTF8_SEQ.search(_cp1252_bytes(run)):
            return f"mojibake {run!r} (UTF-8 decoded as cp1252)"
    m = _BAD_CHAR.search(s)
    if m:
        c = ord(m.group())
        what = ("a lone surrogate" if 0xD800 <= c <= 0xDFFF else "a replacement character" if c == 0xFFFD
                else "a control character")
        return f"{what} U+{c:04X}"
    return ""


def _strings(value: Any, where: str = "") -> list[tuple[str, str]]:
    """(where, string) for every string (and key) nested in ``value``."""
    if isinstance(value, str):
        return [(where, value)]
    if isinstance(value, Mapping):
        out = []
        for k, v in value.items():
            out += [(f"{where}.{k}".lstrip("."), str(k))] if isinstance(k, str) and text_problem(k) else []
            out += _strings(v, f"{where}.{k}".lstrip("."))
        return out
    if isinstance(value, list | tuple):
        return [x for i, v in enumerate(value) for x in _strings(v, f"{where}[{i}]")]
    return []


def _hygiene(msgs: Sequence[Any]) -> str:
    for i, m in enumerate(msgs):
        for where, s in _strings(m):
            if where.endswith("arguments") and s.strip().startswith("{"):
                try:  # arguments as a JSON string: check what it decodes to as well
                    inner = _strings(json.loads(s), where)
                except ValueError:
                    inner = []
                for w2, s2 in inner:
                    if p := text_problem(s2):
                        return f"message {i + 1} ({_role(m)}) {w2}: {p}"
            if p := text_problem(s):
                return f"message {i + 1} ({_role(m)}) {where}: {p}"
    return ""


def _role(m: Any) -> str:
    return str(m.get("role")) if isinstance(m, Mapping) else type(m).__name__


def _norm(s: str) -> str:
    return " ".join(str(s).casefold().split())


def _secrets(plan: Sequence[Any]) -> list[str]:
    """The oracle plan's string arguments worth hiding (4+ characters, or 3 with a digit), normalised."""
    out = []
    for call in plan:
        for v in dict(call.arguments).values():
            s = _norm(v) if isinstance(v, str) else ""
            if len(s) >= 4 or (len(s) == 3 and any(ch.isdigit() for ch in s)):
                out.append(s)
    return list(dict.fromkeys(out))


#: the keys a chat message has (OpenAI / HF shape); any other key's name is scanned like its text
_MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "name", "tool_call_id", "reasoning_content", "refusal"})
_ORACLE_WORDS = re.compile(r"oracle[ _-]?plan|privileged (plan|context|solution)|hidden answer", re.I)


def _privileged(m: Mapping[str, Any], i: int, secrets: Sequence[str], seen: str) -> str:
    """An assistant message that states an oracle value not shown yet, or names the oracle's plan."""
    rest = {k: v for k, v in m.items() if k not in ("tool_calls", "role")}
    text = " ".join([*(str(k) for k in rest if k not in _MESSAGE_KEYS), *(s for _, s in _strings(rest))])
    if hit := _ORACLE_WORDS.search(text):
        return f"message {i + 1} (assistant) mentions {hit.group()!r}"
    low, seen_n = _norm(text), _norm(seen)
    for s in secrets:
        if s not in seen_n and re.search(rf"(?<!\w){re.escape(s)}(?!\w)", low):
            return f"message {i + 1} (assistant) states {s!r} (from the oracle's plan) before any observation showed it"
    return ""


def spec_problem(spec_json: Any) -> str:
    """Why ``spec_json`` is not a spec its environment accepts ("" = it is): unparsable, an unknown
    family, a seed that is not a finite integer (``Infinity``, ``NaN``, 1.5), difficulty keys that
    are not the family's axes or values outside them, a negative generation."""
    try:
        d = _loads(spec_json)
    except (ValueError, TypeError):
        return "the spec is not JSON"
    if not isinstance(d, Mapping):
        return f"the spec is a JSON {type(d).__name__}, not an object"
    cls = _family_class(d.get("family"))
    if cls is None:
        return f"unknown environment family {d.get('family')!r}"

    def integral(v: Any) -> bool:
        return (isinstance(v, int) and not isinstance(v, bool)) or (
            isinstance(v, float) and math.isfinite(v) and v.is_integer())

    if not integral(d.get("seed")):
        return f"seed {d.get('seed')!r} is not a finite integer"
    diff = d.get("difficulty")
    if not isinstance(diff, Mapping):
        return "the spec has no difficulty object"
    names = {ax.name for ax in cls.axes}
    if set(diff) != names:
        return f"difficulty keys {sorted(map(str, diff))} are not {cls.family}'s axes {sorted(names)}"
    for ax in cls.axes:
        v = diff[ax.name]
        if not integral(v):
            return f"difficulty {ax.name}={v!r} is not an integer"
        if not ax.low <= int(v) <= ax.high:
            return f"difficulty {ax.name}={int(v)} is outside {cls.family}'s range [{ax.low}, {ax.high}]"
    gen = d.get("generation", 0)
    if not integral(gen) or int(gen) < 0:
        return f"generation {gen!r} is not a non-negative integer"
    if not isinstance(d.get("extra", {}), Mapping):
        return "the spec's extra is not an object"
    return ""


def _as_json(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, default=str)


def _flag(v: Any) -> bool | None:
    if v is True or v is False:
        return v
    if isinstance(v, int | float) and not isinstance(v, bool) and v in (0, 1):
        return bool(v)
    return None


def _number(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def audit_episode(spec: Any, messages: Any, tools: Any, success: Any = None, reward: Any = None,
                  family: Any = None, difficulty: Any = None) -> dict[str, str]:
    """Every :data:`EPISODE_CHECKS` finding of one teacher episode: check -> first problem ("" = none).

    Never raises: a spec the environment cannot build, or an environment that raises while replaying,
    is a finding of its own."""
    return dict(_audit(_as_json(spec), _as_json(messages), _as_json(tools), _flag(success), _number(reward),
                       None if family is None else str(family), None if difficulty is None else _as_json(difficulty)))


@functools.lru_cache(maxsize=8192)
def _audit(spec_json: str, messages: str, tools: str, success: bool | None, reward: float | None,
           family: str | None, difficulty: str | None) -> tuple[tuple[str, str], ...]:
    out = dict.fromkeys(EPISODE_CHECKS, "")
    try:
        msgs = _loads(messages)
    except (ValueError, TypeError):
        msgs = None
    if not isinstance(msgs, list) or not all(isinstance(m, Mapping) for m in msgs):
        out["protocol"] = "the messages are not a JSON list of message objects"
        return tuple(out.items())
    out["hygiene"] = _hygiene(msgs)
    if reward is None:
        out["reward"] = "the reward is not a finite number"
    elif success is not None and success != (reward >= 1.0):
        out["reward"] = f"success={success} but reward={reward:g} (success is exactly reward 1.0)"
    bad = spec_problem(spec_json)
    if not bad:
        from apprentice.envs.base import ProblemSpec

        sp = ProblemSpec.from_json(spec_json)
        if family is not None and family != sp.family:
            bad = f"the row's family {family!r} is not the spec's {sp.family!r}"
        elif difficulty is not None:
            try:
                row_diff = {str(k): float(v) for k, v in dict(_loads(difficulty)).items()}
            except (ValueError, TypeError):
                row_diff = {}
            if row_diff != {k: float(v) for k, v in sp.difficulty.items()}:
                bad = f"the row's difficulty {_short(difficulty, 80)} is not the spec's {dict(sp.difficulty)}"
    if bad:
        out["spec"] = bad
        return tuple(out.items())
    try:
        out.update(_walk(sp, msgs, tools, success, reward))
    except Exception as e:  # noqa: BLE001 - an environment that raises on this spec is a finding, not a crash
        out["spec"] = f"the environment cannot replay this spec ({type(e).__name__}: {_short(str(e), 120)})"
    return tuple(out.items())


def _walk(spec: Any, msgs: list[Mapping[str, Any]], tools: str, success: bool | None,
          reward: float | None) -> dict[str, str]:
    """Replay ``msgs`` in a fresh environment the way the rollout engine records an episode."""
    from apprentice.envs.base import ToolCall

    found: dict[str, str] = {}

    def note(check: str, text: str) -> None:
        found.setdefault(check, text)

    env = _family_class(spec.family)()
    try:
        task = env.reset(spec=spec)
        plan = env.oracle()
        names = type(env).tool_names()
        n = len(msgs)
        if n < 2 or msgs[0].get("role") != "system" or msgs[0].get("content") != env.system_prompt:
            got = msgs[0].get("content") if n else None
            note("env_messages", f"message 1 is not the environment's system prompt ({_short(str(got), 60)!r})")
            return found
        if msgs[1].get("role") != "user" or msgs[1].get("content") != task:
            note("env_messages", f"message 2 is not the task the environment renders for this spec "
                                 f"({_short(str(msgs[1].get('content')), 60)!r} vs {_short(task, 60)!r})")
            return found
        seen = "\n".join([env.system_prompt, tools, task])
        secrets = _secrets(plan)
        ended_at = 0
        i = 2
        while i < n:
            m = msgs[i]
            role = m.get("role")
            if ended_at:
                note("protocol", f"message {i + 1} ({role}) comes after the episode ended (message {ended_at})")
                return found
            if role != "assistant":
                what = {"tool": "a tool result with no call before it", "system": "a second system prompt",
                        "user": "a user turn that follows no reply without a tool call"}.get(str(role), f"role {role!r}")
                note("protocol" if role != "system" else "env_messages", f"message {i + 1} is {what}")
                return found
            if p := _privileged(m, i, secrets, seen):
                note("privileged", p)
            raw_calls = m.get("tool_calls") or []
            if not isinstance(raw_calls, list):
                note("protocol", f"message {i + 1}'s tool_calls is not a list")
                return found
            if not raw_calls:  # a parse error: format feedback follows, or the transcript ends here
                if i + 1 < n:
                    fb = msgs[i + 1]
                    text = str(fb.get("content"))
                    if fb.get("role") != "user":
                        note("protocol", f"message {i + 1} (assistant) has no tool call, and no format-error "
                                         f"feedback follows it (message {i + 2} is {fb.get('role')})")
                        return found
                    if not text.startswith("Error: ") or not text.endswith(f"Available tools: {', '.join(names)}."):
                        note("env_messages", f"message {i + 2} ({fb.get('role')}) is not the format-error feedback "
                                             "the rollout gives after a reply without a tool call")
                        return found
                    seen += "\n" + text
                i += 2
                continue
            j = i + 1
            for k, raw in enumerate(raw_calls):
                fn = raw.get("function", raw) if isinstance(raw, Mapping) else {}
                name = fn.get("name") if isinstance(fn, Mapping) else None
                try:
                    args = _loads(fn.get("arguments", {}) or {})
                except ValueError:
                    args = None
                if env.done:  # the engine runs no call after the end; a result for it would be a lie
                    if j < n and msgs[j].get("role") == "tool":
                        note("protocol", f"message {j + 1} answers call {k + 1} of message {i + 1} ({name}), made "
                                         "after the episode ended")
                        return found
                    note("after_end", f"call {k + 1} of message {i + 1} ({name}) comes after the episode ended "
                                      "and has no result")
                    continue
                res = msgs[j] if j < n else None
                if res is None or res.get("role") != "tool":
                    what = "the transcript ends" if res is None else f"message {j + 1} is {res.get('role')}"
                    note("protocol", f"call {k + 1} of message {i + 1} ({name}) has no result ({what})")
                    return found
                if res.get("name") not in (None, name):
                    note("protocol", f"message {j + 1} is the result of {res.get('name')!r} but answers call "
                                     f"{k + 1} of message {i + 1} ({name})")
                    return found
                cid, rid = raw.get("id") if isinstance(raw, Mapping) else None, res.get("tool_call_id")
                if rid is not None and rid != cid:
                    note("protocol", f"message {j + 1} answers call id {rid!r}, but call {k + 1} of message {i + 1} "
                                     f"has id {cid!r}")
                    return found
                if not isinstance(name, str) or not name or not isinstance(args, Mapping):
                    note("protocol", f"call {k + 1} of message {i + 1} has no tool name or arguments that are not a "
                                     "JSON object (the rollout records such a reply as a parse error, not a call)")
                    return found
                call = ToolCall(name, dict(args))
                if name in names and (g := env.ungrounded(call, seen)):
                    note("grounding", f"message {i + 1}: {g}")
                try:
                    obs = env.execute(call)
                except Exception as e:  # noqa: BLE001 - the rollout engine turns a raising tool into an observation
                    obs = f"Error: tool {name} failed: {type(e).__name__}: {e}"
                if str(res.get("content")) != str(obs):
                    note("replay", f"message {j + 1} (tool observation) is not the environment's "
                                   f"({_short(str(res.get('content')), 60)!r} vs {_short(str(obs), 60)!r})")
                    return found
                seen += "\n" + str(obs)
                j += 1
            if env.done:
                ended_at = j
            i = j
        won = env.get_reward()
        if success is not None and success != (won >= 1.0):
            note("replay", f"success={success} recorded, but replaying the calls earns reward {won:g}")
        elif reward is not None and abs(reward - won) > 1e-6:
            note("reward", f"reward={reward:g} recorded, but replaying the calls earns {won:g}")
        return found
    finally:
        del env  # a sandboxed family releases its container (shell: on deletion)


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


#: how a finding of each check reads in the SFT exclusion list (the text before ':' is its kind)
CHECK_LABELS = {"spec": "invalid spec", "env_messages": "environment messages differ", "protocol": "protocol violation",
                "replay": "replay disagrees", "reward": "reward inconsistent", "after_end": "call after the end",
                "grounding": "ungrounded action", "privileged": "privileged information", "hygiene": "text hygiene"}


def episode_rejections(df: pd.DataFrame, success_only: bool, max_message_chars: int) -> list[dict[str, Any]]:
    """:func:`row_rejections` of the rejected rows only."""
    return [r for r in row_rejections(df, success_only, max_message_chars) if r is not None]


def row_rejections(df: pd.DataFrame, success_only: bool, max_message_chars: int) -> list[dict[str, Any] | None]:
    """Per row (None = kept in the SFT set), every teacher episode kept out of the SFT set, in row order: ``problem_id``, ``sample_idx``,
    ``check`` (its kind), ``effect`` ("fails the gate" or "excluded") and ``reason``.

    Order of precedence: a row the rollout marked failed (excluded: it holds no episode); a finding
    that fails the gate (:data:`EPISODE_CHECKS` "fail": the data lies); not a success (under
    ``success_only``); truncated; a malformed assistant turn; an invalid tool call or error observation;
    a message over ``max_message_chars``; an "exclude" finding (hygiene, grounding, privileged
    information, a call after the end). Zero tolerance: SFT trains on every assistant token it keeps."""
    missing = [c for c in SFT_COLUMNS if c not in df.columns]
    if missing:
        return [{"problem_id": str(r.get("problem_id")), "sample_idx": _plain(r.get("sample_idx")), "check": "schema",
                 "effect": "fails the gate", "reason": f"teacher table lacks column {missing[0]!r}"}
                for r in df.to_dict("records")]
    failed = rollout_failed(df)
    findings = _episode_findings(df, {})
    out: list[dict[str, Any] | None] = []
    for (_, r), gone, found in zip(df.iterrows(), failed, findings, strict=True):
        success = r["success"] is True or (not isinstance(r["success"], str) and r["success"] == 1)
        check, effect, reason = "", "excluded", ""
        fails = [c for c, (eff, _) in EPISODE_CHECKS.items() if eff == "fail" and found[c]]
        if gone:
            check, reason = "rollout failed", f"rollout failed: {_rollout_error(r.get('extra'))}"
        elif fails:
            check, effect = fails[0], "fails the gate"
            reason = f"{CHECK_LABELS[check]}: {found[check]}"
        elif success_only and not success:
            check, reason = "success", "not a success"
        elif not (r["truncated"] is False or r["truncated"] == 0):
            check, reason = "truncated", "truncated"
        elif turn := _turn_problem(r["messages"]):
            check, reason = "turns", f"malformed turn: {turn}"
        elif call := _call_problem(r["messages"], r["tools"]):
            check, reason = "tool calls", call
        else:
            try:
                too_long = [i for i, m in enumerate(_loads(r["messages"])) if _message_chars(m) > max_message_chars]
            except (ValueError, TypeError, AttributeError):
                too_long = [0]
            excl = [c for c, (eff, _) in EPISODE_CHECKS.items() if eff == "exclude" and found[c]]
            if too_long:
                check, reason = "length", f"message too long: message {too_long[0] + 1} exceeds {max_message_chars} characters"
            elif excl:
                check, reason = excl[0], f"{CHECK_LABELS[excl[0]]}: {found[excl[0]]}"
        out.append({"problem_id": str(r.get("problem_id")), "sample_idx": _plain(r.get("sample_idx")),
                    "check": check, "effect": effect, "reason": reason} if reason else None)
    return out


def _plain(v: Any) -> Any:
    """A numpy scalar as a plain Python value (the report is JSON)."""
    return v.item() if hasattr(v, "item") else v


def sft_exclusions(df: pd.DataFrame, success_only: bool, max_message_chars: int) -> list[str]:
    """Why each teacher episode is kept out of the SFT set ("" = kept), one per row
    (:func:`episode_rejections` has the order and each rejection's check and effect)."""
    return ["" if r is None else str(r["reason"]) for r in row_rejections(df, success_only, max_message_chars)]


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
        fmt["unexpected_index_column_names"] = ["problem_id"] + (["sample_idx"] if "sample_idx" in frame.columns else [])
    result = batch_def.get_batch(batch_parameters={"dataframe": frame}).validate(
        gx_suite, expectation_parameters=dict(params or {}), result_format=fmt)
    res = json.loads(json.dumps(result.to_json_dict(), default=str))  # numpy scalars -> plain JSON
    checks = []
    for r in res["results"]:
        cfg, out = r["expectation_config"], r.get("result") or {}
        kwargs = {k: v for k, v in cfg["kwargs"].items() if k != "batch_id"}
        if isinstance(kwargs.get("value_set"), list) and len(kwargs["value_set"]) > 8:
            kwargs["value_set"] = f"<{len(kwargs['value_set'])} values>"
        index = [x for x in out.get("unexpected_index_list") or [] if isinstance(x, dict)]
        ids = [str(x.get("problem_id")) for x in index]
        eps = [episode_name(x.get("problem_id"), x["sample_idx"]) for x in index if "sample_idx" in x]
        checks.append(Check(cfg["type"], kwargs, bool(r["success"]), out.get("observed_value"),
                            out.get("unexpected_count"), (out.get("partial_unexpected_list") or [])[:5],
                            list(dict.fromkeys(ids))[:MAX_IDS], list(dict.fromkeys(eps))[:MAX_IDS]))
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
                     "<th>arguments</th><th>observed</th><th>bad rows (examples)</th><th>episodes / problem ids</th></tr>")
        for c in sorted(r.checks, key=lambda c: c.success):
            status = "PASS" if c.success else "FAIL"
            bad = "" if not c.unexpected_count else f"{c.unexpected_count}: {_short(c.examples, 300)}"
            parts.append(f"<tr><td class='{status}'>{status}</td><td>{html.escape(c.expectation)}</td>"
                         f"<td><code>{html.escape(_short(c.kwargs, 400))}</code></td>"
                         f"<td><code>{html.escape('' if c.observed is None else _short(c.observed))}</code></td>"
                         f"<td><code>{html.escape(bad)}</code></td>"
                         f"<td><code>{html.escape(', '.join(c.episodes or c.problem_ids))}</code></td></tr>")
        parts.append("</table>")
    if excluded:
        counts = reason_counts(excluded)
        n_fail = sum(e.get("effect") == "fails the gate" for e in excluded)
        parts.append(f"<h2>Episodes excluded from the SFT set: {len(excluded)}</h2><p>"
                     + (f"{n_fail} of them fail the gate (the transcript contradicts the environment or the "
                        "config); the others are excluded and the gate still passes. " if n_fail else "")
                     + "; ".join(f"{html.escape(k)}: {v}" for k, v in counts.items())
                     + "</p><table><tr><th>episode (problem id / sample)</th><th>check</th><th>effect</th>"
                     "<th>reason</th></tr>")
        parts.extend(f"<tr><td><code>{html.escape(episode_name(e.get('problem_id'), e.get('sample_idx')))}</code></td>"
                     f"<td>{html.escape(str(e.get('check', '')))}</td>"
                     f"<td class='{'FAIL' if e.get('effect') == 'fails the gate' else ''}'>"
                     f"{html.escape(str(e.get('effect', 'excluded')))}</td>"
                     f"<td>{html.escape(str(e.get('reason')))}</td></tr>"
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
