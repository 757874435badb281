"""Policies on the real stack: HFPolicy on a tiny random model, OpenAICompatiblePolicy over real
HTTP against real server processes (``python -m apprentice.infra.serve`` and a flaky stdlib server)."""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from apprentice.policies.hf import HFPolicy
from apprentice.policies.openai_compat import OpenAICompatiblePolicy, PolicyHTTPError
from apprentice.policies.toolcalls import calls_of

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-test-SECRET-7f3a9c"  # must never show up in logs or exception text
TOOLS = [{"type": "function", "function": {
    "name": "move", "description": "Move one cell.",
    "parameters": {"type": "object", "properties": {"direction": {"type": "string"}}, "required": ["direction"]}}}]


def _conv(k: int) -> list[dict]:
    return [{"role": "system", "content": "You are in a grid."},
            {"role": "user", "content": "Reach the goal" + " quickly" * k + "."}]


CONVS = [_conv(0), _conv(7), _conv(19)]  # three different prompt lengths -> real left padding


@pytest.fixture(scope="module")
def varied_model_dir(smol_tokenizer_dir, tmp_path_factory) -> str:
    """Like tiny_model_dir but with larger init so greedy output depends on the prompt (the
    default 0.02 init emits one token forever, which would make equality checks vacuous)."""
    from apprentice.lm.modeling import load_tokenizer, make_tiny_model

    out = tmp_path_factory.mktemp("varied") / "model"
    return str(make_tiny_model(load_tokenizer(smol_tokenizer_dir), out, seed=0, initializer_range=0.3))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not up after {timeout}s")


def _start(cmd: list[str], health: str, env: dict[str, str]) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_http(health, proc)
    except BaseException:
        proc.kill()
        raise
    return proc


def _stop(proc: subprocess.Popen) -> str:
    proc.terminate()
    try:
        _, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err or ""


# ---- HFPolicy ---------------------------------------------------------------------------------

def test_hf_policy_batch_is_deterministic_and_matches_single(varied_model_dir):
    policy = HFPolicy(varied_model_dir, max_new_tokens=12, batch_size=8, dtype="fp32")
    batch = policy.act(CONVS, [TOOLS] * 3)
    assert len(batch) == 3
    prompt_lens = [t.prompt_tokens for t in batch]
    assert len(set(prompt_lens)) == 3 and prompt_lens == sorted(prompt_lens)
    for t in batch:
        assert 0 < t.completion_tokens <= 12 and t.message["role"] == "assistant"
        assert t.extra["finish_reason"] in {"stop", "length"}
    assert len({t.raw for t in batch}) == 3, "outputs should differ per prompt on this model"
    again = policy.act(CONVS, [TOOLS] * 3)
    assert [t.raw for t in again] == [t.raw for t in batch]
    single = [policy.act([c], [TOOLS])[0] for c in CONVS]  # left padding: same as unbatched
    assert [t.raw for t in single] == [t.raw for t in batch]
    # sub-batches of batch_size give the same answers too
    small = HFPolicy(policy.model, policy.tokenizer, max_new_tokens=12, batch_size=2, dtype="fp32")
    assert [t.raw for t in small.act(CONVS, [TOOLS] * 3)] == [t.raw for t in batch]


def test_hf_policy_sampling_is_seeded(tiny_model_dir):
    a = HFPolicy(tiny_model_dir, temperature=1.0, max_new_tokens=8, seed=3, dtype="fp32")
    b = HFPolicy(a.model, a.tokenizer, temperature=1.0, max_new_tokens=8, seed=3, dtype="fp32")
    first = [t.raw for t in a.act(CONVS, [TOOLS] * 3)]
    assert first == [t.raw for t in b.act(CONVS, [TOOLS] * 3)]
    c = HFPolicy(a.model, a.tokenizer, temperature=1.0, max_new_tokens=8, seed=4, dtype="fp32")
    assert first != [t.raw for t in c.act(CONVS, [TOOLS] * 3)], "the seed must matter"


# ---- OpenAICompatiblePolicy against python -m apprentice.infra.serve ---------------------------------

def test_openai_policy_against_real_serve_process(varied_model_dir, caplog):
    port = _free_port()
    proc = _start([sys.executable, "-m", "apprentice.infra.serve", "--model", varied_model_dir, "--port", str(port),
                   "--name", "tiny", "--dtype", "fp32", "--api-key-env", "APPRENTICE_TEST_KEY"],
                  f"http://127.0.0.1:{port}/health", {"APPRENTICE_TEST_KEY": KEY, "HF_HUB_OFFLINE": "1"})
    try:
        os.environ["APPRENTICE_TEST_KEY"] = KEY
        caplog.set_level(logging.DEBUG)
        remote = OpenAICompatiblePolicy(f"http://127.0.0.1:{port}/v1", "tiny", api_key_env="APPRENTICE_TEST_KEY",
                                        max_tokens=12, timeout=120)
        turns = remote.act(CONVS, [TOOLS] * 3)
        local = HFPolicy(varied_model_dir, max_new_tokens=12, dtype="fp32").act(CONVS, [TOOLS] * 3)
        # same model, same greedy decoding, real HTTP in between -> same messages and token counts
        assert [t.message for t in turns] == [t.message for t in local]
        assert [(t.prompt_tokens, t.completion_tokens) for t in turns] == [
            (t.prompt_tokens, t.completion_tokens) for t in local]
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert models.json()["data"][0]["id"] == "tiny"

        os.environ["APPRENTICE_WRONG_KEY"] = "sk-wrong-" + KEY[::-1]
        wrong = OpenAICompatiblePolicy(f"http://127.0.0.1:{port}/v1", "tiny", api_key_env="APPRENTICE_WRONG_KEY",
                                       max_retries=3, backoff_s=5.0)
        t0 = time.monotonic()
        with pytest.raises(PolicyHTTPError, match="401") as exc:
            wrong.act([CONVS[0]], [TOOLS])
        assert time.monotonic() - t0 < 5.0, "401 must not be retried"
        assert os.environ["APPRENTICE_WRONG_KEY"] not in str(exc.value) + repr(wrong)
        assert KEY not in caplog.text and KEY not in repr(remote)
    finally:
        os.environ.pop("APPRENTICE_TEST_KEY", None)
        os.environ.pop("APPRENTICE_WRONG_KEY", None)
        server_log = _stop(proc)
    assert KEY not in server_log


# ---- retries against a flaky server ------------------------------------------------------------

FLAKY = textwrap.dedent('''
    import json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    KEY = sys.argv[2]
    count = {"n": 0}
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def _send(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def do_GET(self):
            self._send(200, {"posts": count["n"]})
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            count["n"] += 1
            if self.headers.get("Authorization") != "Bearer " + KEY:
                return self._send(401, {"error": "bad key"})
            if "/always500/" in self.path or count["n"] <= 2:
                # a careless server that echoes the credential back in its error body
                return self._send(500, {"error": "overloaded", "auth": self.headers.get("Authorization")})
            args = json.dumps({"direction": "up"})
            self._send(200, {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "move", "arguments": args}}]}}],
                "usage": {"prompt_tokens": 11, "completion_tokens": 5}})
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
''')


@pytest.fixture
def flaky_server(tmp_path):
    script = tmp_path / "flaky.py"
    script.write_text(FLAKY)
    port = _free_port()
    proc = _start([sys.executable, str(script), str(port), KEY], f"http://127.0.0.1:{port}/health", {})
    yield f"http://127.0.0.1:{port}"
    _stop(proc)


def test_retries_500_twice_then_succeeds(flaky_server, monkeypatch, caplog):
    monkeypatch.setenv("APPRENTICE_TEST_KEY", KEY)
    caplog.set_level(logging.DEBUG)
    policy = OpenAICompatiblePolicy(f"{flaky_server}/v1", "m", api_key_env="APPRENTICE_TEST_KEY",
                                    max_retries=3, backoff_s=0.01)
    (turn,) = policy.act([CONVS[0]], [TOOLS])
    assert calls_of(turn.message) == [("move", {"direction": "up"})]
    assert (turn.prompt_tokens, turn.completion_tokens) == (11, 5)
    assert httpx.get(f"{flaky_server}/health").json()["posts"] == 3  # 2 failures + 1 success
    assert "retry 2/3" in caplog.text and KEY not in caplog.text


def test_gives_up_after_bounded_retries_without_leaking_key(flaky_server, monkeypatch, caplog):
    monkeypatch.setenv("APPRENTICE_TEST_KEY", KEY)
    caplog.set_level(logging.DEBUG)
    policy = OpenAICompatiblePolicy(f"{flaky_server}/always500/v1", "m", api_key_env="APPRENTICE_TEST_KEY",
                                    max_retries=2, backoff_s=0.01)
    (turn,) = policy.act([CONVS[0]], [TOOLS])  # only this conversation fails (its episode), nothing raises
    assert turn.error and "after 3 attempts" in turn.error
    assert httpx.get(f"{flaky_server}/health").json()["posts"] == 3
    assert "***" in turn.error  # the echoed credential was redacted ...
    assert KEY not in turn.error and KEY not in caplog.text  # ... everywhere


def test_connection_errors_are_retried_then_reported():
    policy = OpenAICompatiblePolicy(f"http://127.0.0.1:{_free_port()}/v1", "m", max_retries=1, backoff_s=0.01,
                                    timeout=2)
    (turn,) = policy.act([CONVS[0]], [TOOLS])  # below the circuit breaker: this request fails, alone
    assert turn.error and re.search("after 2 attempts; last error: ConnectError", turn.error)
