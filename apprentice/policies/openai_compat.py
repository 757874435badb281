"""Any OpenAI-compatible chat-completions endpoint as a policy (a hosted teacher, vLLM, llama.cpp,
or ``python -m apprentice.serve``).

Why hand-written on httpx instead of the ``openai`` SDK: we need four things the SDK hides or
would add a dependency for: our own bounded retry/backoff policy (429, 5xx, connection errors,
``Retry-After``), tolerant parsing that turns a malformed tool call into ``Turn.parse_error``
rather than an exception, a fallback for servers that return tool calls as ``<tool_call>`` text,
and a guarantee that the API key never reaches a log line or an exception message.

A batch is sent as concurrent requests from a thread pool (one conversation per request).
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from apprentice.policies.base import Message, Turn
from apprentice.policies.toolcalls import OPEN, parse_assistant, render_assistant, tool_call

log = logging.getLogger(__name__)
RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


class PolicyHTTPError(RuntimeError):
    """The endpoint failed (after retries, or with a non-retryable status). Never contains the key."""


def to_openai_messages(conversation: list[Message]) -> list[dict[str, Any]]:
    """Our messages (dict arguments, tool results without ids) -> OpenAI wire format (JSON-string
    arguments, ``id`` on each call, ``tool_call_id`` on each tool result, matched in order)."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []
    for i, m in enumerate(conversation):
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            calls: list[dict[str, Any]] = []
            for j, tc in enumerate(m["tool_calls"]):
                f = tc.get("function", tc)
                args = f.get("arguments") or {}
                cid = tc.get("id") or f"call_{i}_{j}"
                calls.append({"id": cid, "type": "function", "function": {
                    "name": f["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
            pending = [str(c["id"]) for c in calls]
            out.append({"role": "assistant", "content": m.get("content") or None, "tool_calls": calls})
        elif role == "tool":
            cid = m.get("tool_call_id") or (pending.pop(0) if pending else f"call_{i}_0")
            out.append({"role": "tool", "tool_call_id": cid, "content": str(m.get("content", ""))})
        else:
            out.append({"role": role, "content": m.get("content", "")})
    return out


def parse_openai_message(msg: dict[str, Any]) -> tuple[Message, str | None]:
    """An OpenAI response message -> (our assistant message, parse error or None). Never raises."""
    content = msg.get("content") or ""
    raw_calls = msg.get("tool_calls") or []
    if not raw_calls:
        if OPEN in content:  # server returned the model's tool-call text unparsed
            return parse_assistant(content)
        return {"role": "assistant", "content": content}, None
    calls = []
    for k, tc in enumerate(raw_calls):
        f = tc.get("function") or {}
        name, args = f.get("name"), f.get("arguments")
        if not isinstance(name, str) or not name:
            return {"role": "assistant", "content": content}, f"tool call {k + 1} has no function name"
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                return ({"role": "assistant", "content": content or f"{name}({args})"},
                        f"tool call {k + 1} ({name}): arguments are not valid JSON ({e.msg})")
        if args is None:
            args = {}
        if not isinstance(args, dict):
            return {"role": "assistant", "content": content}, f"tool call {k + 1} ({name}): arguments must be an object"
        calls.append(tool_call(name, args))
    return {"role": "assistant", "content": content, "tool_calls": calls}, None


class OpenAICompatiblePolicy:
    """``OpenAICompatiblePolicy("http://127.0.0.1:8000/v1", "my-model")``.

    ``api_key_env`` names the environment variable holding the key (read once at construction;
    no key -> no ``Authorization`` header, fine for local servers). ``max_retries`` extra attempts
    follow a retryable failure, sleeping ``backoff_s * 2**attempt`` (+ jitter, capped at 30 s, or
    the server's ``Retry-After``).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key_env: str = "OPENAI_API_KEY",
        timeout: float = 60.0,
        max_retries: int = 3,
        temperature: float = 0.0,
        top_p: float = 1.0,
        max_tokens: int = 96,
        concurrency: int = 8,
        backoff_s: float = 0.5,
        policy_id: str | None = None,
    ) -> None:
        if not base_url:
            raise ValueError("OpenAICompatiblePolicy needs base_url, e.g. http://127.0.0.1:8000/v1 "
                             "(set rollout.teacher.base_url in params.yaml)")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout, self.max_retries, self.backoff_s = timeout, max_retries, backoff_s
        self.temperature, self.top_p, self.max_tokens = temperature, top_p, max_tokens
        self.concurrency = max(1, concurrency)
        self.policy_id = policy_id or f"openai:{model}"
        self._key = os.environ.get(api_key_env) or None
        headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)

    def __repr__(self) -> str:  # the key is deliberately absent
        return f"OpenAICompatiblePolicy(base_url={self.base_url!r}, model={self.model!r})"

    def close(self) -> None:
        self._client.close()

    def _redact(self, text: str) -> str:
        return text.replace(self._key, "***") if self._key else text

    def act(
        self,
        conversations: list[list[Message]],
        tools: list[list[dict[str, Any]]],
        *,
        contexts: list[dict[str, Any]] | None = None,
    ) -> list[Turn]:
        if len(tools) != len(conversations):
            raise ValueError(f"got {len(conversations)} conversations but {len(tools)} tool lists")
        if len(conversations) == 1:
            return [self._one(conversations[0], tools[0])]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(conversations))) as pool:
            return list(pool.map(self._one, conversations, tools))

    def _one(self, conversation: list[Message], tools: list[dict[str, Any]]) -> Turn:
        body: dict[str, Any] = {
            "model": self.model, "messages": to_openai_messages(conversation),
            "temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens,
        }
        if tools:
            body["tools"] = tools
        data = self._post("/chat/completions", body)
        try:
            choice = data["choices"][0]
            raw_msg = choice["message"]
        except (KeyError, IndexError, TypeError):
            raise PolicyHTTPError(f"{self.base_url}/chat/completions returned no choices: "
                                  f"{self._redact(json.dumps(data)[:300])}") from None
        msg, err = parse_openai_message(raw_msg)
        usage = data.get("usage") or {}
        raw = raw_msg.get("content") or ""
        if raw_msg.get("tool_calls"):
            raw = render_assistant({"content": raw, "tool_calls": raw_msg["tool_calls"]}) if err is None else (
                raw + json.dumps(raw_msg["tool_calls"]))
        return Turn(message=msg, prompt_tokens=int(usage.get("prompt_tokens") or 0),
                    completion_tokens=int(usage.get("completion_tokens") or 0), parse_error=err, raw=raw,
                    extra={"finish_reason": choice.get("finish_reason")})

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        url = f"{self.base_url}{path}"
        last = ""
        for attempt in range(self.max_retries + 1):
            retry_after: float | None = None
            try:
                r = self._client.post(path, json=body)
            except httpx.TransportError as e:  # connect/read timeouts, refused, reset
                last = self._redact(f"{type(e).__name__}: {e}")
            else:
                if r.status_code < 400:
                    try:
                        return r.json()
                    except ValueError:
                        raise PolicyHTTPError(f"{url} returned non-JSON ({r.status_code})") from None
                snippet = self._redact(r.text[:300])
                if r.status_code not in RETRY_STATUS:
                    raise PolicyHTTPError(f"{url} answered {r.status_code}: {snippet} "
                                          "(not retried; check model name, request and API key env var)")
                last = f"HTTP {r.status_code}: {snippet}"
                ra = r.headers.get("retry-after")
                if ra and ra.replace(".", "", 1).isdigit():
                    retry_after = float(ra)
            if attempt < self.max_retries:
                delay = retry_after if retry_after is not None else min(
                    30.0, self.backoff_s * 2 ** attempt * (1 + 0.1 * random.random()))
                log.warning("POST %s failed (%s); retry %d/%d in %.2fs", url, last, attempt + 1,
                            self.max_retries, delay)
                time.sleep(delay)
        raise PolicyHTTPError(f"{url} failed after {self.max_retries + 1} attempts; last error: {last}")
