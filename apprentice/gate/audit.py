"""The episode audit: every way a transcript can lie, judged in a fresh environment.

:func:`audit_episode` replays one teacher episode on its spec and returns a finding per check of
:data:`EPISODE_CHECKS`; :func:`spec_problem` and :func:`text_problem` judge a spec and a string on
their own. :func:`row_rejections` (and :func:`episode_rejections`, :func:`sft_exclusions`) turns the
findings, plus success, truncation, turn format, tool-call validity and message length, into the
list of episodes kept out of the SFT set, each with its reason and whether it fails the gate. The
small parsing helpers at the top (JSON-schema validators, family lookup) are shared with the derived
columns of :mod:`apprentice.gate.columns`.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from apprentice.gate.results import _short


@functools.lru_cache(maxsize=256)
def _validator(schema_json: str) -> Any:
    import jsonschema

    schema = json.loads(schema_json)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema)


def _loads(s: Any) -> Any:
    return json.loads(s) if isinstance(s, str) else s


@functools.lru_cache(maxsize=64)
def _tool_validators(tools_json: str) -> dict[str, Any]:
    out = {}
    for t in json.loads(tools_json):
        fn = t.get("function", t)
        out[fn["name"]] = _validator(json.dumps(fn.get("parameters") or {"type": "object"}, sort_keys=True))
    return out


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


def _episode_findings(df: pd.DataFrame, spec: Mapping[str, Any]) -> list[dict[str, str]]:
    """:func:`audit_episode` of every row (columns named by ``spec``; a missing optional one is skipped)."""
    def col(key: str, default: str) -> Any:
        name = spec.get(key, default)
        return df[name] if name in df.columns else pd.Series([None] * len(df), index=df.index)

    cols = [col("spec_from", "spec"), col("from", "messages"), col("tools_from", "tools"),
            col("success_from", "success"), col("reward_from", "reward"), col("family_from", "family"),
            col("difficulty_from", "difficulty")]
    return [audit_episode(*row) for row in zip(*cols, strict=True)]


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


def _message_chars(m: Mapping[str, Any]) -> int:
    calls = m.get("tool_calls") or []
    return len(str(m.get("content") or "")) + sum(len(json.dumps(c, default=str)) for c in calls)


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
    "grounding": ("exclude", "every argument of every call uses only what earlier observations showed: no secret "
                             "of the problem before it was observable (apprentice.gate.secrets), and what the "
                             "environment's own check allows (Environment.ungrounded)"),
    "privileged": ("exclude", "no assistant turn states a secret value, a run of the oracle's route or the oracle "
                              "plan before it was shown (values derived by arithmetic on seen numbers are not secret)"),
    "hygiene": ("exclude", "no control character, ANSI escape, NUL, lone surrogate or mojibake in any message"),
    "markup": ("exclude", "no message content holds a control token of the chat template in use or its tool-call / "
                          "tool-result markup (apprentice.gate.protocol)"),
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


#: the keys a chat message has (OpenAI / HF shape); any other key's name is scanned like its text
_MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "name", "tool_call_id", "reasoning_content", "refusal"})
_ORACLE_WORDS = re.compile(r"oracle[ _-]?plan|privileged (plan|context|solution)|hidden answer", re.I)


def _assistant_text(m: Mapping[str, Any]) -> str:
    """Everything an assistant message says besides its calls (content, reasoning, stray keys)."""
    rest = {k: v for k, v in m.items() if k not in ("tool_calls", "role")}
    return " ".join([*(str(k) for k in rest if k not in _MESSAGE_KEYS), *(s for _, s in _strings(rest))])


def _privileged(m: Mapping[str, Any], i: int, know: Any) -> str:
    """An assistant message that states a secret value or a run of the oracle's route before any
    observation showed it, or names the oracle's plan (:mod:`apprentice.gate.secrets`)."""
    text = _assistant_text(m)
    if hit := _ORACLE_WORDS.search(text):
        return f"message {i + 1} (assistant) mentions {hit.group()!r}"
    know.derive(text)
    if s := know.stated(text):
        return f"message {i + 1} (assistant) states {s!r} (from the oracle's plan) before any observation showed it"
    if r := know.route(text):
        return f"message {i + 1} (assistant) states the {r} (from the oracle's plan) before any observation showed it"
    return ""


def _markup(msgs: Sequence[Any], markers: Sequence[str]) -> str:
    """The first message whose content (text, call names or arguments) holds a control token of the
    chat template in use or its tool-call / tool-result markup: rendered for training, it would
    teach the model to forge a tool result or another turn."""
    if not markers:
        return ""
    for i, m in enumerate(msgs):
        if not isinstance(m, Mapping):
            continue
        fields = {k: v for k, v in m.items() if k not in ("role", "tool_call_id")}
        for where, text in _strings(fields):
            if where.endswith("arguments") and text.strip().startswith("{"):
                try:
                    inner = [t for _, t in _strings(json.loads(text))]
                except ValueError:
                    inner = []
                text = " ".join([text, *inner])
            hits = [(text.find(mark), -len(mark), mark) for mark in markers if mark in text]
            if hits:  # the first marker in reading order
                return f"message {i + 1} ({_role(m)}) {where} holds the chat template's {min(hits)[2]!r}"
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
    is a finding of its own. The markup check uses the protocol markers in use
    (:func:`apprentice.gate.protocol.markers`)."""
    from apprentice.gate.protocol import markers

    return dict(_audit(_as_json(spec), _as_json(messages), _as_json(tools), _flag(success), _number(reward),
                       None if family is None else str(family), None if difficulty is None else _as_json(difficulty),
                       markers()))


@functools.lru_cache(maxsize=8192)
def _audit(spec_json: str, messages: str, tools: str, success: bool | None, reward: float | None,
           family: str | None, difficulty: str | None,
           protocol: tuple[str, ...] = ()) -> tuple[tuple[str, str], ...]:
    out = dict.fromkeys(EPISODE_CHECKS, "")
    try:
        msgs = _loads(messages)
    except (ValueError, TypeError):
        msgs = None
    if not isinstance(msgs, list) or not all(isinstance(m, Mapping) for m in msgs):
        out["protocol"] = "the messages are not a JSON list of message objects"
        return tuple(out.items())
    out["hygiene"] = _hygiene(msgs)
    out["markup"] = _markup(msgs, protocol)
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
    from apprentice.gate.secrets import Knowledge, plan_calls

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

        env_cls = type(env)

        def observe_plan() -> str:  # what the oracle's own path shows: the values the problem hides
            other = env_cls()
            try:
                other.reset(spec=spec)
                return "\n".join(other.execute(c) for c in plan)
            finally:
                del other

        know = Knowledge(seen, plan_calls(plan), observe_plan)
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
            if p := _privileged(m, i, know):
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
                    know.show(text)
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
                if hidden := know.unseen_in(dict(args)):
                    note("grounding", f"message {i + 1}: call {k + 1} ({name}) uses {hidden[0]!r}, a value of the "
                                      "problem no earlier observation showed")
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
                know.show(str(obs))
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


# ---- the SFT set: which teacher episodes are kept out of it, and why ---------------------------

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
                if isinstance(fn.get("arguments"), str):  # the OpenAI wire format, not what templates render
                    return (f"invalid tool call: message {i + 1} stores the arguments of {fn.get('name')!r} as a JSON "
                            "string, not an object (the chat template would encode them twice)")
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
                "grounding": "ungrounded action", "privileged": "privileged information", "hygiene": "text hygiene",
                "markup": "protocol markup in content"}


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
