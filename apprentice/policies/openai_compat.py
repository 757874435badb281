"""Any OpenAI-compatible chat-completions endpoint as a policy (a hosted teacher, vLLM, llama.cpp,
or ``python -m apprentice.infra.serve``).

Why hand-written on httpx instead of the ``openai`` SDK: we need five things the SDK hides or
would add a dependency for: our own bounded retry/backoff policy (429, 5xx, connection errors,
``Retry-After``, a 200 whose body is not the JSON it should be), tolerant parsing that turns a
malformed tool call into ``Turn.parse_error`` rather than an exception, a fallback for servers that
return tool calls as ``<tool_call>`` text, a circuit breaker shared by all requests, and a guarantee
that the API key never reaches a log line or an exception message.

A batch is sent as concurrent requests from a thread pool (one conversation per request). Failures
are handled per request, so one unlucky request never costs the batch:

* transient (connection refused/reset, timeouts, 408/409/425/429/5xx, a truncated or non-JSON 200
  body, a 200 without ``choices``): retried up to ``max_retries`` times with backoff (or the
  server's ``Retry-After``); when they are spent, that conversation's :class:`Turn` carries
  ``error`` and the engine ends only that episode as failed;
* another 4xx (400, 413, 422: this request is wrong, e.g. too long): that turn fails at once;
* permanent (401/403: the key; 404: the URL or model name) and the circuit breaker:
  :class:`~apprentice.policies.base.PolicyUnavailable` is raised and the rollout stops. The breaker
  (:class:`CircuitBreaker`) opens after ``circuit_breaker`` refused connections in a row (nothing
  listening: one clear error at once), or when timeouts have gone on, unanswered, for as long as one
  request's retries take (a slow start, or one wave of concurrent timeouts, does not open it; a
  server that never answers does, not after every problem has spent its retries). Threads sleeping
  in a backoff wake up when it opens.

Every request has a total deadline of ``timeout`` seconds (connect, headers and body together: a
body that trickles in a byte at a time cannot hold a rollout), and a reply over ``max_reply_bytes``
is not read on (that turn fails, naming the limit). The key is scrubbed from every reply before
anything reads it, so a server that echoes it into a message cannot get it into a table, and from
every error and log line.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

from apprentice.policies.base import Message, PolicyUnavailable, Turn
from apprentice.policies.toolcalls import OPEN, parse_assistant, render_assistant, tool_call

log = logging.getLogger(__name__)
RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
#: statuses that every later request would get too (the key, the URL or the model name is wrong)
PERMANENT_STATUS = {401: "the API key was rejected: check the variable rollout.teacher.api_key_env names",
                    403: "the API key may not use this model: check the key and rollout.teacher.model",
                    404: "no such route or model: check rollout.teacher.base_url (ends in /v1) and "
                         "rollout.teacher.model"}
#: the longest wait a ``Retry-After`` header may ask for
MAX_RETRY_AFTER_S = 120.0


class PolicyHTTPError(RuntimeError):
    """One request failed (after retries, or with a non-retryable status). Never contains the key."""


class EndpointUnavailable(PolicyHTTPError, PolicyUnavailable):
    """The endpoint cannot serve any request (a permanent status, or the circuit breaker opened)."""


class _Deadline(Exception):
    """A request ran past its total deadline (internal)."""


class _Transient(Exception):
    """A failure worth retrying (internal; its message is already redacted)."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def retry_after_s(header: str | None) -> float | None:
    """A ``Retry-After`` header (seconds or an HTTP date) as seconds to wait, capped; None if absent."""
    text = (header or "").strip()
    if not text:
        return None
    try:
        wait = float(text)
    except ValueError:
        try:
            wait = (parsedate_to_datetime(text) - datetime.now(UTC)).total_seconds()
        except (TypeError, ValueError):
            return None
    return min(MAX_RETRY_AFTER_S, max(0.0, wait))


class CircuitBreaker:
    """Decides that an endpoint is down, across every request of one client. Opening sets
    :attr:`opened`, an event the backoff sleeps wait on, so they stop at once.

    Two kinds of evidence, because they mean different things. A refused connection is proof that
    nothing listens: ``limit`` of them in a row open the breaker at once. A timeout only says the
    server is slow, and one wave of concurrent requests times out together: timeouts open it only when
    the failures have lasted ``window_s`` (the time one request needs to spend all its retries) with no
    answer in between and number at least ``limit``. So a slow start (the first requests time out,
    then the server answers) never opens it, and a server that never answers opens it after about one
    request's retry span, not after every problem has spent its own. Any answer resets both counts."""

    def __init__(self, limit: int, window_s: float = 0.0) -> None:
        self.limit = max(1, int(limit))
        self.window_s = max(0.0, float(window_s))
        self.opened = threading.Event()
        self.reason = ""
        self._refused = 0
        self._failures = 0
        self._since: float | None = None
        self._lock = threading.Lock()

    def failure(self, what: str, refused: bool = False, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._failures += 1
            self._since = now if self._since is None else self._since
            self._refused = self._refused + 1 if refused else 0
            slow = self._failures >= self.limit and now - self._since >= self.window_s
            if (self._refused >= self.limit or slow) and not self.opened.is_set():
                self.reason = what
                self.opened.set()

    def success(self) -> None:
        with self._lock:
            self._refused = self._failures = 0
            self._since = None


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
        circuit_breaker: int = 8,
        max_reply_bytes: int = 2_000_000,
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
        self.max_reply_bytes = max(1, int(max_reply_bytes))
        self._key = os.environ.get(api_key_env) or None
        headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout,
                                    limits=httpx.Limits(max_connections=max(self.concurrency, 10)))
        # timeouts open the breaker only after one request's whole retry span (attempts + backoffs)
        span = (max_retries + 1) * timeout + sum(min(30.0, backoff_s * 2 ** a) for a in range(max_retries))
        self.breaker = CircuitBreaker(circuit_breaker, window_s=span)

    def __repr__(self) -> str:  # the key is deliberately absent
        return f"OpenAICompatiblePolicy(base_url={self.base_url!r}, model={self.model!r})"

    def close(self) -> None:
        self._client.close()

    def _redact(self, text: str) -> str:
        return text.replace(self._key, "***") if self._key else text

    def _scrub(self, value: Any) -> Any:
        """``value`` (a parsed reply) with the key removed from every string and key in it: a server
        that echoes the credential into a reply must not get it into an episode table."""
        if not self._key:
            return value
        if isinstance(value, str):
            return self._redact(value)
        if isinstance(value, dict):
            return {self._scrub(k): self._scrub(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._scrub(v) for v in value]
        return value

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
            return [self._turn(conversations[0], tools[0])]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(conversations))) as pool:
            return list(pool.map(self._turn, conversations, tools))

    def _turn(self, conversation: list[Message], tools: list[dict[str, Any]]) -> Turn:
        """One conversation's turn; a request that failed for good becomes a Turn with ``error``
        (only that episode fails), a :class:`PolicyUnavailable` stops the whole rollout."""
        try:
            return self._one(conversation, tools)
        except EndpointUnavailable:
            raise
        except PolicyHTTPError as e:
            return Turn(message={"role": "assistant", "content": ""}, error=str(e))

    def _one(self, conversation: list[Message], tools: list[dict[str, Any]]) -> Turn:
        body: dict[str, Any] = {
            "model": self.model, "messages": to_openai_messages(conversation),
            "temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens,
        }
        if tools:
            body["tools"] = tools
        data = self._post("/chat/completions", body)
        choice, raw_msg = data["choices"][0], data["choices"][0]["message"]  # checked by _post
        msg, err = parse_openai_message(raw_msg)
        usage = data.get("usage") or {}
        raw = raw_msg.get("content") or ""
        if raw_msg.get("tool_calls"):
            raw = render_assistant({"content": raw, "tool_calls": raw_msg["tool_calls"]}) if err is None else (
                raw + json.dumps(raw_msg["tool_calls"]))
        return Turn(message=msg, prompt_tokens=int(usage.get("prompt_tokens") or 0),
                    completion_tokens=int(usage.get("completion_tokens") or 0), parse_error=err, raw=raw,
                    extra={"finish_reason": choice.get("finish_reason")})

    def _unavailable(self) -> EndpointUnavailable:
        return EndpointUnavailable(
            f"{self.base_url} is unavailable: {self.breaker.limit} refused connections in a row, or timeouts with no "
            f"answer for {self.breaker.window_s:.1f} s (circuit breaker; last: {self.breaker.reason}); start the "
            "server or fix rollout.teacher.base_url, "
            "or raise rollout.teacher.timeout_s if it is only slow")

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        url = f"{self.base_url}{path}"
        last = ""
        for attempt in range(self.max_retries + 1):
            if self.breaker.opened.is_set():
                raise self._unavailable()
            try:
                return self._attempt(path, body)
            except _Transient as e:
                last, retry_after = str(e), e.retry_after
            if attempt < self.max_retries:
                delay = retry_after if retry_after is not None else min(
                    30.0, self.backoff_s * 2 ** attempt * (1 + 0.1 * random.random()))
                log.warning("POST %s failed (%s); retry %d/%d in %.2fs", url, last, attempt + 1,
                            self.max_retries, delay)
                if self.breaker.opened.wait(delay):  # the breaker opened meanwhile: stop now
                    raise self._unavailable()
        if self.breaker.opened.is_set():
            raise self._unavailable()
        raise PolicyHTTPError(f"{url} failed after {self.max_retries + 1} attempts; last error: {last}")

    def _attempt(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One POST: the parsed body, or :class:`_Transient` (retry), :class:`PolicyHTTPError` (this
        request is wrong) or :class:`EndpointUnavailable` (every request would fail)."""
        url = f"{self.base_url}{path}"
        try:
            status, headers, raw = self._exchange(path, body)
        except httpx.TransportError as e:  # connect/read timeouts, refused, reset, closed mid-answer
            what = self._redact(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            self.breaker.failure(what, refused=isinstance(e, httpx.ConnectError))
            raise _Transient(what) from None
        except _Deadline as e:
            self.breaker.failure(str(e))
            raise _Transient(str(e)) from None
        self.breaker.success()  # the server answered: it is there
        if raw is None:
            raise PolicyHTTPError(f"{url} sent a reply over rollout.teacher.max_reply_bytes ({self.max_reply_bytes} "
                                  f"bytes; status {status}); it is not read or stored (not retried)")
        text = raw.decode("utf-8", errors="replace")
        snippet = self._redact(" ".join(text[:300].split()))
        if status < 400:
            try:
                data = self._scrub(json.loads(text))
                if not isinstance(data["choices"][0]["message"], dict):  # the shape every caller relies on
                    raise TypeError("message is not an object")
            except (ValueError, KeyError, IndexError, TypeError):
                # a truncated or HTML body behind a proxy, or a 200 with an error object: transient
                raise _Transient(f"HTTP {status} with a body that is not a chat completion: "
                                 f"{snippet[:200]!r}") from None
            return data
        if status in PERMANENT_STATUS:
            raise EndpointUnavailable(f"{url} answered {status}: {snippet} ({PERMANENT_STATUS[status]}; "
                                      "not retried)")
        if status not in RETRY_STATUS:
            raise PolicyHTTPError(f"{url} answered {status}: {snippet} "
                                  "(not retried; check the request: model name, max_new_tokens, prompt length)")
        raise _Transient(f"HTTP {status}: {snippet}", retry_after_s(headers.get("retry-after")))

    def _exchange(self, path: str, body: dict[str, Any]) -> tuple[int, httpx.Headers, bytes | None]:
        """One POST within a total deadline of ``timeout`` seconds (connect, headers and body together:
        httpx's timeouts bound each read, so a body that trickles in a byte at a time would hold the
        request forever). The exchange runs on a helper thread that the caller stops waiting for at
        the deadline; it stops reading at the deadline or at ``max_reply_bytes`` (body None)."""
        deadline = time.monotonic() + self.timeout
        box: dict[str, Any] = {}
        done = threading.Event()

        def work() -> None:
            try:
                with self._client.stream("POST", path, json=body) as r:
                    size = r.headers.get("content-length", "")
                    if size.isdigit() and int(size) > self.max_reply_bytes:
                        box["result"] = (r.status_code, r.headers, None)
                        return
                    buf = bytearray()
                    for chunk in r.iter_bytes():
                        buf += chunk
                        if len(buf) > self.max_reply_bytes:
                            box["result"] = (r.status_code, r.headers, None)
                            return
                        if time.monotonic() > deadline:
                            return
                    box["result"] = (r.status_code, r.headers, bytes(buf))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=work, daemon=True, name="openai-request").start()
        if not done.wait(max(0.0, deadline - time.monotonic())) or "result" not in box and "error" not in box:
            raise _Deadline(f"Timeout: no complete reply within {self.timeout:g} s (connect, headers and body; "
                            "rollout.teacher.timeout_s)")
        if "error" in box:
            raise box["error"]
        return box["result"]
