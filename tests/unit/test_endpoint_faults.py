"""Rollouts against a real OpenAI-compatible HTTP server that injects faults.

The server (a ``ThreadingHTTPServer`` on a free port, real sockets, real ``httpx`` client) answers
like an oracle endpoint: it knows each test problem's solution by its task text and replies with the
next call, so a healthy run ends with every episode solved and the counts are exact. Faults are
injected per request: flapping 500s, 429 with ``Retry-After``, hangs past the client timeout, a
truncated JSON body, one problem that fails every attempt, a wrong key (401), and nothing listening.
Timeouts and backoffs are small so the file runs in seconds."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from apprentice.config import Config
from apprentice.data.trajectories import problems_frame, write_parquet
from apprentice.envs import FAMILIES
from apprentice.paths import Paths, failures_file
from apprentice.policies.base import PolicyUnavailable
from apprentice.rollout import shards

KEY = "sk-fault-SECRET-19d2"


class FaultServer:
    """An oracle chat-completions endpoint with scripted faults. ``fault(n, task)`` picks the fault of
    the n-th request (1-based, over the server's life) for a conversation whose task text is ``task``:
    None, "500", "429", "hang", "truncated"."""

    def __init__(self, plans: dict[str, list[dict[str, Any]]], fault=None, key: str = KEY) -> None:
        self.plans, self.fault, self.key = plans, fault or (lambda n, task: None), key
        self.posts = 0
        self.answered: Counter[str] = Counter()  # task -> successful completions
        self.seen: Counter[str] = Counter()  # task -> requests
        self.lock = threading.Lock()
        self.max_parallel = self._parallel = 0
        srv = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def _send(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                task = next(m["content"] for m in req["messages"] if m["role"] == "user")
                with srv.lock:
                    srv.posts += 1
                    n = srv.posts
                    srv.seen[task] += 1
                    srv._parallel += 1
                    srv.max_parallel = max(srv.max_parallel, srv._parallel)
                try:
                    self._answer(req, task, n)
                finally:
                    with srv.lock:
                        srv._parallel -= 1

            def _answer(self, req: dict[str, Any], task: str, n: int) -> None:
                if self.headers.get("Authorization") != f"Bearer {srv.key}":  # echoes the credential back
                    return self._send(401, json.dumps({"error": "bad key",
                                                       "got": self.headers.get("Authorization")}).encode())
                what = srv.fault(n, task)
                if what == "500":
                    return self._send(500, json.dumps({"error": "overloaded",
                                                       "auth": self.headers.get("Authorization")}).encode())
                if what == "429":
                    return self._send(429, b'{"error": "slow down"}', {"Retry-After": "0.2"})
                if what == "hang":
                    time.sleep(1.5)  # past the client's timeout
                    return None
                step = sum(m["role"] == "assistant" for m in req["messages"])
                call = srv.plans[task][min(step, len(srv.plans[task]) - 1)]
                body = json.dumps({"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                    "role": "assistant", "content": None, "tool_calls": [{"id": f"c{step}", "type": "function",
                    "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]}}],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 3}}).encode()
                if what == "truncated":
                    return self._send(200, body[: len(body) // 2])
                if what == "trickle":  # a byte a second: every read is quick, the whole body is not
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    for b in body[:20]:
                        self.wfile.write(bytes([b]))
                        self.wfile.flush()
                        time.sleep(1.0)
                    return None
                if what in ("echo", "big"):
                    msg = json.loads(body)
                    msg["choices"][0]["message"]["content"] = (f"my key is {srv.key}" if what == "echo" else "x" * 300_000)
                    body = json.dumps(msg).encode()
                with srv.lock:
                    srv.answered[task] += 1
                return self._send(200, body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _problems(paths: Paths, n: int) -> tuple[pd.DataFrame, dict[str, list[dict[str, Any]]], list[str]]:
    """``n`` distinct grid problems (written as the iteration's problems), their oracle plans keyed by
    task text, and the task texts in problem order."""
    grid = FAMILIES["grid"]
    specs, tasks, plans = [], [], {}
    seed = 0
    while len(specs) < n:
        spec = grid.generate(seed, seed % 3)
        seed += 1
        env = grid()
        task = env.reset(spec=spec)
        if task in plans:
            continue
        plans[task] = [{"name": c.name, "arguments": dict(c.arguments)} for c in env.oracle()]
        specs.append(spec)
        tasks.append(task)
    df = problems_frame(specs, [s.seed % 3 for s in specs], split="train")
    write_parquet(df, paths.problems)
    return df, plans, tasks


def _cfg(url: str, **teacher: Any) -> Config:
    rollout = teacher.pop("rollout", {})
    return Config.model_validate({"rollout": {"shard_size": 64, **rollout, "teacher": {
        "kind": "openai", "model": "m", "base_url": url, "api_key_env": "APPRENTICE_FAULT_KEY",
        "timeout_s": 0.5, "max_retries": 3, "batch_size": 8, **teacher}}})


def _run(cfg: Config, paths: Paths) -> dict[str, Any]:
    from apprentice.stages import rollout as stage

    return stage.run(cfg, paths, progress=False)


@pytest.fixture(autouse=True)
def _key(monkeypatch):
    monkeypatch.setenv("APPRENTICE_FAULT_KEY", KEY)


def _no_key_anywhere(root: Path, *texts: str) -> None:
    for t in texts:
        assert KEY not in t
    for f in root.rglob("*"):
        if f.is_file():
            assert KEY.encode() not in f.read_bytes(), f


def test_every_transient_fault_ends_complete_with_exact_counts(tmp_path, caplog):
    paths = Paths(tmp_path)
    df, plans, tasks = _problems(paths, 12)
    faults = {tasks[0]: "500", tasks[1]: "500", tasks[2]: "429", tasks[3]: "hang", tasks[4]: "truncated",
              tasks[5]: "429"}
    hits: Counter[str] = Counter()

    def fault(n: int, task: str) -> str | None:  # each faulty problem's first two requests fail
        hits[task] += 1
        return faults.get(task) if hits[task] <= 2 else None

    srv = FaultServer(plans, fault)
    try:
        t0 = time.monotonic()
        out = _run(_cfg(srv.url), paths)
        wall = time.monotonic() - t0
    finally:
        srv.close()
    assert out["episodes"] == 12 and out["success_rate"] == 1.0
    table = pd.read_parquet(out["out"])
    assert not shards.failed_mask(table).any()
    assert int(table["turns"].sum()) == sum(srv.answered.values())  # one completion per turn, none lost
    assert srv.max_parallel > 1, "the batch must stay concurrent"
    assert not failures_file(paths.teacher_trajectories).exists()
    assert wall < 20, wall
    _no_key_anywhere(tmp_path, caplog.text)


def test_a_problem_failing_every_attempt_is_named_and_alone_replayed(tmp_path, caplog):
    paths = Paths(tmp_path)
    df, plans, tasks = _problems(paths, 12)
    doomed = tasks[7]
    srv = FaultServer(plans, lambda n, task: "500" if task == doomed else None)
    try:
        with pytest.raises(shards.EpisodesFailed) as exc:
            # no hang is injected here: a 5 s timeout keeps a loaded machine's slow server thread from
            # turning an attempt into a client timeout it never counted (seen would be 2, not 3)
            _run(_cfg(srv.url, max_retries=2, timeout_s=5.0), paths)
    finally:
        srv.close()
    msg = str(exc.value)
    pid = df["problem_id"].iloc[7]
    assert "1 of 12 episodes failed" in msg and f"problem {pid} (family grid" in msg and "HTTP 500" in msg
    assert srv.seen[doomed] == 3 * (1 + shards.REPLAYS)  # 1 + 2 retries per pass, no serial replay of the shard
    assert all(srv.seen[t] == len(plans[t]) for t in tasks if t != doomed)
    lines = [json.loads(x) for x in failures_file(paths.teacher_trajectories).read_text().splitlines()]
    assert [(r["problem_id"], r["family"]) for r in lines] == [(pid, "grid")] and "HTTP 500" in lines[0]["error"]
    assert "***" in lines[0]["error"] and KEY not in msg  # the echoed credential is redacted

    healthy = FaultServer(plans)  # another port: transport is not part of the fingerprint
    try:
        out = _run(_cfg(healthy.url, max_retries=5, timeout_s=2.0), paths)
    finally:
        healthy.close()
    assert out["episodes"] == 12 and out["success_rate"] == 1.0
    assert set(healthy.seen) == {doomed}  # the 11 finished episodes were kept
    assert not failures_file(paths.teacher_trajectories).exists()
    _no_key_anywhere(tmp_path, caplog.text)


def test_error_budget_keeps_failed_rows_marked(tmp_path):
    paths = Paths(tmp_path)
    df, plans, tasks = _problems(paths, 12)
    srv = FaultServer(plans, lambda n, task: "500" if task == tasks[3] else None)
    try:
        out = _run(_cfg(srv.url, max_retries=1, rollout={"error_budget": 0.1}), paths)
    finally:
        srv.close()
    table = pd.read_parquet(out["out"])
    mask = shards.failed_mask(table)
    assert len(table) == 12 and mask.sum() == 1
    row = table[mask].iloc[0]
    assert row["problem_id"] == df["problem_id"].iloc[3] and not row["success"]
    assert json.loads(row["extra"])["failed"] is True and "HTTP 500" in json.loads(row["extra"])["error"]
    assert failures_file(paths.teacher_trajectories).exists()


def test_nothing_listening_stops_fast_whatever_the_problem_count(tmp_path):
    paths = Paths(tmp_path)
    _problems(paths, 40)
    t0 = time.monotonic()
    with pytest.raises(PolicyUnavailable, match="circuit breaker.*ConnectError") as exc:
        _run(_cfg(f"http://127.0.0.1:{_free_port()}/v1", max_retries=3), paths)
    assert time.monotonic() - t0 < 10
    assert exc.value.retryable is False and "\n" not in str(exc.value)


def test_a_server_that_never_answers_trips_the_breaker(tmp_path):
    paths = Paths(tmp_path)
    df, plans, _ = _problems(paths, 24)
    srv = FaultServer(plans, lambda n, task: "hang")
    try:
        t0 = time.monotonic()
        with pytest.raises(PolicyUnavailable, match="circuit breaker.*Timeout"):
            _run(_cfg(srv.url, timeout_s=0.3), paths)
        assert time.monotonic() - t0 < 10
        assert srv.posts <= 8 * 4 + 8  # about one wave's retries, not 24 problems x 4 attempts
    finally:
        srv.close()


def test_wrong_key_is_one_clear_error_and_not_retried(tmp_path, monkeypatch, capsys):
    paths = Paths(tmp_path)
    df, plans, _ = _problems(paths, 6)
    srv = FaultServer(plans)
    monkeypatch.setenv("APPRENTICE_FAULT_KEY", "sk-wrong-key-000")
    try:
        with pytest.raises(PolicyUnavailable, match="401.*api_key_env") as exc:
            _run(_cfg(srv.url), paths)
        assert srv.posts <= 8  # one wave of concurrent requests, none retried
        assert "sk-wrong-key-000" not in str(exc.value)
    finally:
        srv.close()


def test_cli_marks_permanent_failures_and_prefect_does_not_retry_them(tmp_path):
    """The CLI's error line carries the marker; the stage task turns it into a not-retryable failure
    and the task's retry condition refuses to retry it (a transient StageFailed is retried)."""
    from prefect.states import Failed

    from apprentice import pipeline
    from apprentice.__main__ import main
    from apprentice.pipeline import NOT_RETRYABLE
    from tasks._dvc import StageFailed, StageNotRetryable, stage_failed
    from tasks.stages import _task, retryable

    paths = Paths(tmp_path)
    _problems(paths, 3)
    params = tmp_path / "params.yaml"
    params.write_text(json.dumps({"rollout": {"teacher": {
        "kind": "openai", "model": "m", "base_url": f"http://127.0.0.1:{_free_port()}/v1", "timeout_s": 0.5}}}))
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["rollout", "--params", str(params), "--root", str(tmp_path)])
    assert rc == 1 and NOT_RETRYABLE in err.getvalue() and "Traceback" not in err.getvalue()
    tail = err.getvalue()
    assert isinstance(stage_failed("teacher-rollout-1", 1, tail), StageNotRetryable)
    assert not retryable(None, None, Failed(data=stage_failed("teacher-rollout-1", 1, tail)))
    assert retryable(None, None, Failed(data=StageFailed("x", 1, "boom")))
    task = _task(pipeline.get("teacher-rollout"))
    assert task.retries == pipeline.ROLLOUT_RETRIES and task.retry_condition_fn is retryable


def test_a_trickling_body_is_cut_at_the_total_deadline(tmp_path):
    paths = Paths(tmp_path)
    df, plans, tasks = _problems(paths, 4)
    hits: Counter[str] = Counter()

    def fault(n: int, task: str) -> str | None:
        hits[task] += 1
        return "trickle" if task == tasks[0] and hits[task] == 1 else None

    srv = FaultServer(plans, fault)
    try:
        t0 = time.monotonic()
        out = _run(_cfg(srv.url, timeout_s=1.0), paths)
        wall = time.monotonic() - t0
    finally:
        srv.close()
    assert out["episodes"] == 4 and out["success_rate"] == 1.0
    assert wall < 8, wall  # the trickle would hold its request for 20 s


@pytest.mark.parametrize("mode", ["echo", "big"])
def test_echoed_keys_are_scrubbed_and_huge_replies_fail_only_their_turn(tmp_path, caplog, mode):
    paths = Paths(tmp_path)
    df, plans, tasks = _problems(paths, 4)
    srv = FaultServer(plans, lambda n, task: mode if task == tasks[1] else None)
    try:
        cfg = _cfg(srv.url, max_reply_bytes=100_000, rollout={"error_budget": 0.5})
        out = _run(cfg, paths)
    finally:
        srv.close()
    table = pd.read_parquet(out["out"])
    assert len(table) == 4
    if mode == "echo":
        assert out["success_rate"] == 1.0 and "my key is ***" in table["messages"].iloc[1]
    else:
        assert shards.failed_mask(table).sum() == 1 and "max_reply_bytes" in shards.failures(table)[0]
    _no_key_anywhere(tmp_path, caplog.text)


def test_a_slow_start_does_not_trip_the_breaker(tmp_path):
    paths = Paths(tmp_path)
    df, plans, tasks = _problems(paths, 12)
    start = time.monotonic()
    srv = FaultServer(plans, lambda n, task: "hang" if time.monotonic() - start < 1.2 else None)
    try:
        out = _run(_cfg(srv.url, timeout_s=0.5, batch_size=12), paths)
    finally:
        srv.close()
    assert out["episodes"] == 12 and out["success_rate"] == 1.0


def test_flap_every_third_request_finishes_every_episode(tmp_path):
    paths = Paths(tmp_path)
    df, plans, tasks = _problems(paths, 12)
    srv = FaultServer(plans, lambda n, task: "500" if n % 3 == 0 else None)
    try:
        out = _run(_cfg(srv.url, timeout_s=2.0), paths)
    finally:
        srv.close()
    assert out["episodes"] == 12 and out["success_rate"] == 1.0


@pytest.mark.parametrize(("events", "opens"), [
    ([(0.0, False)] * 8, False),  # one wave of concurrent timeouts
    ([(t / 4, False) for t in range(30)], True),  # timeouts for longer than the window
    ([(0.0, True)] * 8, True),  # nothing listening: refused connections in a row
    ([(t / 4, False) for t in range(10)] + [(2.6, None)] + [(2.7 + t / 4, False) for t in range(7)], False),
])
def test_breaker_counts_failures_over_time(events, opens):
    from apprentice.policies.openai_compat import CircuitBreaker

    b = CircuitBreaker(8, window_s=4.0)
    for t, refused in events:
        if refused is None:
            b.success()
        else:
            b.failure("x", refused=refused, now=t)
    assert b.opened.is_set() is opens
