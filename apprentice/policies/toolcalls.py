"""Tool calls as text: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

This is the format the compact and Qwen2.5 chat templates render and TRL's ``qwen3_template``
response parser reads. We keep our own small text parser, and do not call
``tokenizer.parse_response`` at rollout time, because (1) the oracle and OpenAI-compatible
policies have no tokenizer, and (2) TRL's ``parse_response`` silently falls back to plain text on
malformed output, while the rollout engine needs the *reason* to show the agent an error
observation and count it. ``tests/unit/test_toolcalls.py`` checks that both parsers agree on
well-formed output, so what RL training parses and what rollouts parse cannot drift apart.

Messages use the HF / OpenAI shape with ``arguments`` as a dict (what chat templates render):
``{"role": "assistant", "content": str, "tool_calls": [{"type": "function", "function": {...}}]}``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
# end-of-turn markers a decoder may leave in the text; everything after the first one is dropped
_STOPS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")

Message = dict[str, Any]


def canonical_arguments(arguments: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """Call arguments as the one stored form, an object: a JSON string (OpenAI's wire format) is
    decoded here, where a call enters, so no table holds both forms (a chat template given a string
    encodes it a second time). Raises ``ValueError`` for a string that is not a JSON object."""
    if arguments is None:
        return {}
    if isinstance(arguments, str):
        value = json.loads(arguments) if arguments.strip() else {}
        if not isinstance(value, dict):
            raise ValueError(f"arguments must be a JSON object, got {type(value).__name__}")
        return value
    if not isinstance(arguments, Mapping):
        raise ValueError(f"arguments must be an object, got {type(arguments).__name__}")
    return dict(arguments)


def tool_call(name: str, arguments: Mapping[str, Any] | str | None = None) -> dict[str, Any]:
    """One ``tool_calls`` entry of an assistant message (arguments as an object: :func:`canonical_arguments`)."""
    return {"type": "function", "function": {"name": name, "arguments": canonical_arguments(arguments)}}


def assistant_message(content: str = "", calls: Iterable[Mapping[str, Any]] = ()) -> Message:
    """An assistant message; ``calls`` are ``{"name", "arguments"}`` dicts or ``tool_call`` entries
    (either way stored in the canonical form)."""
    msg: Message = {"role": "assistant", "content": content}
    entries = [tool_call(c["function"]["name"], c["function"].get("arguments")) if "function" in c
               else tool_call(c["name"], c.get("arguments")) for c in calls]
    if entries:
        msg["tool_calls"] = entries
    return msg


def render_call(name: str, arguments: Mapping[str, Any]) -> str:
    """Exactly what the chat templates render for one call (``json.dumps`` = their ``tojson``)."""
    return f'{OPEN}\n{{"name": "{name}", "arguments": {json.dumps(dict(arguments), ensure_ascii=False)}}}\n{CLOSE}'


def render_assistant(message: Mapping[str, Any]) -> str:
    """The assistant text a model should generate for ``message`` (no role header, no end token)."""
    parts = [message["content"]] if message.get("content") else []
    for tc in message.get("tool_calls") or []:
        f = tc.get("function", tc)
        args = f.get("arguments") or {}
        if isinstance(args, str):
            args = json.loads(args)
        parts.append(render_call(f["name"], args))
    return "\n".join(parts)


def _strip_stops(text: str) -> str:
    cut = min((i for i in (text.find(s) for s in _STOPS) if i >= 0), default=len(text))
    return text[:cut]


def _parse_call(body: str, index: int) -> tuple[dict[str, Any] | None, str | None]:
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError as e:
        return None, f"tool call {index + 1} is not valid JSON ({e.msg} at char {e.pos})"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None, f'tool call {index + 1} must be an object {{"name": "<tool>", "arguments": {{...}}}}'
    args = obj.get("arguments", obj.get("parameters", {}))
    if args is None:
        args = {}
    if isinstance(args, str):  # some models double-encode the arguments, as OpenAI's wire format does
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None, f"tool call {index + 1}: 'arguments' is a string that is not JSON"
    if not isinstance(args, dict):
        return None, f"tool call {index + 1}: 'arguments' must be an object, got {type(args).__name__}"
    extra = set(obj) - {"name", "arguments", "parameters"}
    if extra:
        return None, f"tool call {index + 1} has unexpected keys {sorted(extra)}; use only name and arguments"
    return tool_call(obj["name"], args), None


def parse_assistant(text: str) -> tuple[Message, str | None]:
    """Parse generated text into an assistant message. Never raises.

    Returns ``(message, None)`` on success (``tool_calls`` present when the text had any) and
    ``(content-only message with the raw text, reason)`` when a tool call is malformed: unclosed
    or stray tags, invalid JSON, or a JSON value that is not ``{"name", "arguments"}``.
    """
    text = _strip_stops(text)
    n_open, n_close = text.count(OPEN), text.count(CLOSE)
    blocks = list(_BLOCK.finditer(text))
    error: str | None = None
    if n_open != n_close or len(blocks) != n_open:
        error = ("unclosed <tool_call> (missing </tool_call>)" if n_open > n_close
                 else "stray </tool_call> without <tool_call>")
    calls: list[dict[str, Any]] = []
    if error is None:
        for i, m in enumerate(blocks):
            call, error = _parse_call(m.group(1), i)
            if error:
                break
            calls.append(call)  # type: ignore[arg-type]
    if error:
        return {"role": "assistant", "content": text.strip()}, error
    content = _BLOCK.sub("", text).strip()
    return assistant_message(content, calls), None


def calls_of(message: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """``[(name, arguments), ...]`` of an assistant message, whatever the entry shape."""
    out = []
    for tc in message.get("tool_calls") or []:
        f = tc.get("function", tc)
        args = f.get("arguments") or {}
        out.append((f["name"], json.loads(args) if isinstance(args, str) else dict(args)))
    return out
