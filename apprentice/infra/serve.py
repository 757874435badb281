"""A small OpenAI-compatible server for a local model: ``python -m apprentice.infra.serve --model models/base``.

It lets anything that speaks chat completions with tools (``OpenAICompatiblePolicy``, other
agent frameworks, curl) use a pipeline model, and it is the real server the integration tests
talk to. It is a thin FastAPI layer over the same engine the rollouts use (``CachedHFPolicy``: a
client's next turn reuses the keys/values of the conversation so far), in the project's own
environment, serving a model folder the moment it is written. vLLM's CPU build also serves these
folders (its ``hermes`` tool-call parser reads the template's ``<tool_call>`` format, its prefix
cache reuses a conversation's earlier turns), but from an environment of its own (it pins an older
transformers) and after compiling the model at start-up; ``bench/engine_peak.py --vllm-url`` compares
the two on the same token ids.

Concurrent requests are micro-batched: a worker thread takes every request that arrives within
``batch_window_s`` (same sampling settings, up to ``batch_size``) into one ``generate`` call, so a
client sending a batch of conversations in parallel gets batched-generation throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any

from fastapi import FastAPI, HTTPException, Request

from apprentice.policies.base import Turn

log = logging.getLogger(__name__)


def from_openai_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI wire messages -> the chat-template shape (dict arguments; tool results keep content)."""
    out = []
    for m in messages:
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}] parts
            m["content"] = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        elif content is None:
            m["content"] = ""
        if m.get("tool_calls"):
            calls = []
            for tc in m["tool_calls"]:
                f = tc.get("function", tc)
                args = f.get("arguments") or {}
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        raise HTTPException(400, f"tool call {f.get('name')!r}: arguments are not JSON") from None
                calls.append({"type": "function", "function": {"name": f["name"], "arguments": args}})
            m["tool_calls"] = calls
        out.append(m)
    return out


def to_openai_response(turn: Turn, model: str) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": turn.message.get("content") or None}
    finish = turn.extra.get("finish_reason", "stop")
    if turn.parse_error:  # hand the client the raw text; its parser reports the same error
        msg["content"] = turn.raw
    elif turn.tool_calls:
        msg["tool_calls"] = [
            {"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
             "function": {"name": tc["function"]["name"], "arguments": json.dumps(tc["function"]["arguments"])}}
            for tc in turn.tool_calls
        ]
        finish = "tool_calls" if finish == "stop" else finish
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:16]}", "object": "chat.completion", "created": int(time.time()),
        "model": model, "choices": [{"index": 0, "message": msg, "finish_reason": finish}],
        "usage": {"prompt_tokens": turn.prompt_tokens, "completion_tokens": turn.completion_tokens,
                  "total_tokens": turn.prompt_tokens + turn.completion_tokens},
    }


class MicroBatcher:
    """One worker thread owns the model; requests with equal sampling settings are batched."""

    def __init__(self, policy: Any, batch_size: int, window_s: float = 0.01) -> None:
        self.policy, self.batch_size, self.window_s = policy, batch_size, window_s
        self.q: queue.Queue[tuple[tuple[Any, ...], list, list, Future]] = queue.Queue()
        threading.Thread(target=self._loop, daemon=True, name="apprentice-serve-batcher").start()

    def submit(self, messages: list, tools: list, params: tuple[Any, ...]) -> Future:
        fut: Future = Future()
        self.q.put((params, messages, tools, fut))
        return fut

    def next_batch(self, held: list) -> list:
        """The oldest request plus every request with its sampling settings: first those held back
        from earlier windows (in arrival order), then what arrives within ``window_s``; requests
        with other settings are held for a later batch, where they are batched together too."""
        batch = [held.pop(0) if held else self.q.get()]
        for item in [h for h in held if h[0] == batch[0][0]][: self.batch_size - 1]:
            held.remove(item)
            batch.append(item)
        deadline = time.monotonic() + self.window_s
        while len(batch) < self.batch_size:
            try:
                item = self.q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            (batch if item[0] == batch[0][0] else held).append(item)
        return batch

    def _loop(self) -> None:
        held: list = []
        while True:
            batch = self.next_batch(held)
            temperature, top_p, max_tokens = batch[0][0]
            try:
                turns = self.policy.complete([b[1] for b in batch], [b[2] for b in batch],
                                             temperature=temperature, top_p=top_p, max_new_tokens=max_tokens)
            except Exception as e:  # report to every waiting request, keep serving
                log.exception("generation failed")
                for b in batch:
                    b[3].set_exception(e)
                continue
            for b, t in zip(batch, turns, strict=True):
                b[3].set_result(t)


def create_app(policy: Any, model_name: str, *, batch_size: int = 16, api_key: str | None = None) -> FastAPI:
    """The FastAPI app around an ``HFPolicy``-like object (needs ``complete`` and defaults)."""
    app = FastAPI(title="apprentice-serve")
    batcher = MicroBatcher(policy, batch_size)

    def _auth(request: Request) -> None:
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            raise HTTPException(401, "missing or wrong API key")

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models(request: Request) -> dict[str, Any]:
        _auth(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "apprentice"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        _auth(request)
        body = await request.json()
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise HTTPException(400, "'messages' must be a non-empty list")
        if body.get("stream"):
            raise HTTPException(400, "stream=true is not supported")
        if int(body.get("n") or 1) != 1:
            raise HTTPException(400, "only n=1 is supported")
        params = (float(body.get("temperature", policy.temperature) or 0.0),
                  float(body.get("top_p", policy.top_p) or 1.0),
                  int(body.get("max_tokens") or body.get("max_completion_tokens") or policy.max_new_tokens))
        fut = batcher.submit(from_openai_messages(body["messages"]), body.get("tools") or [], params)
        turn = await asyncio.wrap_future(fut)
        return to_openai_response(turn, body.get("model") or model_name)

    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m apprentice.infra.serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF folder or id (e.g. models/base)")
    p.add_argument("--name", default=None, help="model name reported by /v1/models (default: folder name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    p.add_argument("--chat-template", default="model", choices=["model", "compact", "qwen2.5"])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--api-key-env", default=None, help="require 'Bearer $THIS_VAR' on every request")
    args = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import uvicorn

    from apprentice.policies.hf_cached import CachedHFPolicy

    policy = CachedHFPolicy(args.model, dtype=args.dtype, chat_template=args.chat_template,
                      batch_size=args.batch_size, max_new_tokens=args.max_new_tokens)
    api_key = os.environ.get(args.api_key_env) if args.api_key_env else None
    if args.api_key_env and not api_key:
        raise SystemExit(f"--api-key-env {args.api_key_env}: that environment variable is empty")
    name = args.name or os.path.basename(os.path.normpath(args.model))
    app = create_app(policy, name, batch_size=args.batch_size, api_key=api_key)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
