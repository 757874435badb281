"""Overhead of the Docker sandbox behind the ``shell`` family (target: median tool call <= 0.5 s).

    python bench/sandbox.py [N_EPISODES]

Prints: container start (cold, and handed out by the warm pool), per-tool-call latency of
``Sandbox.run`` and of the ``ShellEnv`` tools (median / p90), and episode throughput of the batched
rollout engine with the oracle policy on ``shell`` problems next to ``grid`` (no container) as the
ratio of their episodes per second. Run it on a quiet machine: a loaded one (load average >> cores)
measures the load. Needs an engine: eval "$(bash scripts/docker-engine.sh)"; without one (or without
the sandbox image and the means to build it) it prints one line saying so and exits 0, so that
``make bench`` goes on.
"""

from __future__ import annotations

import argparse
import os
import statistics as st
import time

from apprentice.envs import FAMILIES, ToolCall
from apprentice.infra import sandbox as sb
from apprentice.policies.oracle import OraclePolicy
from apprentice.rollout.episodes import run_episodes


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(n: int = 12) -> None:
    ok, where = sb.engine_available()
    if not ok:
        print(f"sandbox: skipped, no Docker engine ({where})")
        return
    try:
        sb.ensure_image()
    except sb.SandboxError as e:
        print(f"sandbox: skipped, no sandbox image ({e})")
        return
    print(f"engine {where}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    lim = sb.SandboxLimits(pool_size=0)
    cold = []
    for _ in range(3):
        t = time.perf_counter()
        b = sb.Sandbox(lim)
        cold.append(time.perf_counter() - t)
        b.close()
    warm_lim = sb.SandboxLimits(pool_size=2)
    sb.Sandbox(warm_lim).close()  # fills the pool
    time.sleep(3)
    t = time.perf_counter()
    box = sb.Sandbox(warm_lim)
    warm = time.perf_counter() - t
    print(f"container start: cold median {st.median(cold):.2f} s; from the warm pool {warm:.3f} s")

    lat = []
    for _ in range(30):
        t = time.perf_counter()
        box.run("echo hello | tr a-z A-Z")
        lat.append(time.perf_counter() - t)
    box.close()
    print(f"Sandbox.run: median {st.median(lat):.3f} s, p90 {pct(lat, 0.9):.3f} s (30 calls)")

    env = FAMILIES["shell"]()
    env.reset(spec=FAMILIES["shell"].make_spec(1, {"tasks": 1, "size": 0, "noise": 0, "budget_slack": 4}))
    env._sandbox()
    tool_lat = []
    for call in [ToolCall("run", {"command": "ls -R"}), ToolCall("read_file", {"path": "data/people.csv"}),
                 ToolCall("write_file", {"path": "notes.txt", "content": "x\n" * 50}),
                 ToolCall("run", {"command": "wc -l data/* logs/* 2>/dev/null"})]:
        t = time.perf_counter()
        env.execute(call)
        tool_lat.append(time.perf_counter() - t)
    env._release()
    print(f"ShellEnv tools: median {st.median(tool_lat):.3f} s, max {max(tool_lat):.3f} s")

    rates = {}
    for fam in ("grid", "shell"):
        specs = [FAMILIES[fam].generate(100 + i, i % 3) for i in range(n)]
        t = time.perf_counter()
        trajs = run_episodes(specs, OraclePolicy(), progress=False)
        dt = time.perf_counter() - t
        calls = sum(x.tool_calls if hasattr(x, "tool_calls") else x.extra["tool_calls"] for x in trajs)
        rates[fam] = n / dt
        ok = sum(x.success for x in trajs)
        print(f"rollout {fam:5s}: {n} oracle episodes ({calls} tool calls) in {dt:.2f} s = "
              f"{rates[fam]:.2f} episodes/s, {ok}/{n} solved")
    print(f"ratio shell/grid episodes per second: {rates['shell'] / rates['grid']:.4f}")
    verdict = "meets" if st.median(lat) <= 0.5 else "misses"
    print(f"median tool call {st.median(lat):.3f} s {verdict} the 0.5 s target")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("episodes", nargs="?", type=int, default=12, help="oracle episodes per family (default 12)")
    main(ap.parse_args().episodes)
