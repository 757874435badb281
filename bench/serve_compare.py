"""Serving, side by side in one run: ``python -m apprentice.infra.serve`` vs ``transformers serve``.

Both serve the same model folder on this machine; the same conversations (a grid episode's first
turn with its tool schema, prompts of varied length) go to each at the same concurrency, greedy,
with the same ``max_tokens``. Printed per server: requests/s, completion tokens/s, how many
replies came back with structured ``tool_calls``, and whether its parser knows this model's
tool-call format at all; then the throughput ratio.

    python bench/serve_compare.py [--model models/base] [--requests 32] [--concurrency 8]

``transformers serve`` needs ``pip install 'transformers[serving]'`` (adds ``openai``); without it
there is nothing to compare against, so the script prints one line saying so and exits 0.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
TOOLS = [{"type": "function", "function": {
    "name": "move", "description": "Move one cell in a direction.",
    "parameters": {"type": "object", "properties": {"direction": {"type": "string",
                                                                  "enum": ["up", "down", "left", "right"]}},
                   "required": ["direction"]}}}]


def conversation(i: int) -> list[dict]:
    far = " Walls block the way;" * (i % 5)
    return [{"role": "system", "content": "You control an agent on a grid. Call the move tool to act."},
            {"role": "user", "content": f"goal: {i % 4 + 1} right, {i % 3} up.{far} blocked: left. Move."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(cmd: list[str], port: int, log: Path, timeout: float = 600) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:3]} exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"{cmd[:3]} did not answer in {timeout} s: {log.read_text()[-2000:]}")


def one(port: int, model: str, i: int, max_tokens: int) -> dict:
    body = {"model": model, "messages": conversation(i), "tools": TOOLS, "temperature": 0.0,
            "max_tokens": max_tokens, "stream": False}
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def measure(name: str, port: int, model: str, n: int, concurrency: int, max_tokens: int) -> dict:
    one(port, model, 0, max_tokens)  # warm-up: model load, first-call allocations
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        replies = list(pool.map(lambda i: one(port, model, i, max_tokens), range(n)))
    wall = time.perf_counter() - t0
    tokens = sum(int((r.get("usage") or {}).get("completion_tokens") or 0) for r in replies)
    tool = sum(bool(r["choices"][0]["message"].get("tool_calls")) for r in replies)
    return {"server": name, "requests": n, "wall_s": wall, "req_per_s": n / wall, "tok_per_s": tokens / wall,
            "completion_tokens": tokens, "tool_call_replies": tool,
            "example": json.dumps(replies[1]["choices"][0]["message"])[:160]}


def hf_parses_tool_calls(model_dir: str) -> str:
    """Does ``transformers serve`` have a response template (its tool-call parser) for this model?"""
    try:
        from transformers import AutoConfig, AutoTokenizer
        from transformers.cli.serving.utils import get_response_template
    except ImportError as e:
        return f"unknown ({e})"

    class _M:  # get_response_template reads only model.config.model_type
        config = AutoConfig.from_pretrained(model_dir)

    tmpl = get_response_template(AutoTokenizer.from_pretrained(model_dir), _M())
    return "yes" if tmpl else f"no (model_type '{_M.config.model_type}' has no response template)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models" / "base"))
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--logs", default="/tmp")
    args = p.parse_args(argv)
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        print("serve_compare: skipped, `transformers serve` is not installed (pip install 'transformers[serving]')")
        return 0
    model = str(Path(args.model).resolve())
    if not (Path(model) / "config.json").exists():
        print(f"no model at {model}: run `python -m apprentice prepare-base` or pass --model", file=sys.stderr)
        return 2
    logs = Path(args.logs)
    results = []
    port = free_port()
    ours = start([sys.executable, "-m", "apprentice.infra.serve", "--model", model, "--port", str(port),
                  "--batch-size", str(args.concurrency), "--max-new-tokens", str(args.max_tokens)],
                 port, logs / "serve_ours.log")
    try:
        results.append(measure("apprentice.infra.serve (micro-batched)", port, "m", args.requests, args.concurrency,
                               args.max_tokens))
    finally:
        ours.terminate()
        ours.wait()
    cli = shutil.which("transformers") or str(Path(sys.executable).parent / "transformers")
    for extra, label in (([], "transformers serve"), (["--continuous-batching"], "transformers serve --continuous-batching")):
        port = free_port()
        try:
            theirs = start([cli, "serve", model, "--host", "127.0.0.1", "--port", str(port), *extra], port,
                           logs / "serve_transformers.log")
        except RuntimeError as e:
            print(f"{label}: not measured: {str(e)[-400:]}")
            continue
        try:
            results.append(measure(label, port, model, args.requests, args.concurrency, args.max_tokens))
        except httpx.HTTPError as e:
            print(f"{label}: failed: {e}")
        finally:
            theirs.terminate()
            theirs.wait()
    print(f"\nmodel {model}; {args.requests} requests, {args.concurrency} concurrent, greedy, max_tokens {args.max_tokens}")
    print(f"{'server':44s} {'req/s':>7s} {'tok/s':>8s} {'tool_calls':>11s}")
    for r in results:
        print(f"{r['server']:44s} {r['req_per_s']:7.2f} {r['tok_per_s']:8.1f} {r['tool_call_replies']:>5d}/{r['requests']}")
    for r in results:
        print(f"  e.g. {r['server']}: {r['example']}")
    print(f"transformers serve parses tool calls for this model: {hf_parses_tool_calls(model)}")
    if len(results) > 1:
        for r in results[1:]:
            print(f"throughput ratio apprentice.infra.serve / {r['server']}: {results[0]['tok_per_s'] / max(r['tok_per_s'], 1e-9):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
