"""``rollout.engine: ray`` on a real local Ray instance: the same episodes as ``local``, in the same
order, whether an actor survives or is killed mid-shard; a clear error for an unreachable cluster."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pandas as pd
import pytest

from apprentice.config import RayConfig, load_config
from apprentice.data.trajectories import problems_frame, read_parquet, write_parquet
from apprentice.envs import FAMILIES
from apprentice.infra import distributed
from apprentice.paths import Paths
from apprentice.policies.oracle import OraclePolicy

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # Ray start-up can time out on a loaded machine: slow suite only


def _specs(n: int = 5):
    return [FAMILIES[f].generate(seed, level) for f in ("grid", "search") for seed in range(n) for level in (0, 2)]


def _transcript(trajs) -> list[tuple]:
    """Everything an episode produced except its wall time."""
    return [(t.problem_id, t.sample_idx, t.level, t.policy_id, t.messages, t.reward, t.success, t.turns,
             t.truncated, t.parse_errors, t.tool_errors, t.completion_tokens) for t in trajs]


def test_ray_oracle_rollout_matches_local_in_problem_order(ray_cluster):
    specs = _specs()
    local = distributed.run_episodes(specs, OraclePolicy, samples_per_problem=2, progress=False)
    sharded = distributed.run_episodes(specs, OraclePolicy, engine="ray", samples_per_problem=2, progress=False,
                                       ray=RayConfig(workers=2, shards_per_worker=2))
    assert len(sharded) == len(specs) * 2
    assert _transcript(sharded) == _transcript(local)
    assert [t.problem_id for t in sharded[::2]] == [s.problem_id for s in specs]


@pytest.mark.parametrize("engine", ["local", "ray"])
def test_on_finish_and_skip_pass_through_either_engine(ray_cluster, engine):
    """The shard journal's keywords: ``local`` hands episodes over as they finish, ``ray`` once its
    actors return; both leave out the skipped (already saved) episodes."""
    specs = _specs(2)
    full = distributed.run_episodes(specs, OraclePolicy, samples_per_problem=2, progress=False)
    skip = frozenset({(specs[0].problem_id, 0), (specs[0].problem_id, 1), (specs[3].problem_id, 1)})
    seen: list = []
    got = distributed.run_episodes(specs, OraclePolicy, engine=engine, samples_per_problem=2, progress=False,
                                   ray=RayConfig(workers=2, shards_per_worker=1), on_finish=seen.append, skip=skip)
    assert _transcript(got) == _transcript([t for t in full if (t.problem_id, t.sample_idx) not in skip])
    assert sorted(_transcript(seen)) == sorted(_transcript(got))


def test_ray_evaluate_stage_writes_the_same_parquet_as_local(ray_cluster, tmp_path, tiny_model_dir):
    """The evaluate stage with a real (tiny, greedy) HF model: episodes and metrics identical."""
    from apprentice.stages import evaluate

    specs = _specs(3)
    paths = Paths(tmp_path, iteration=1)
    write_parquet(problems_frame(specs, [0, 2] * (len(specs) // 2), "eval"), paths.eval_problems)
    common = ["evaluate.max_new_tokens=12", "evaluate.batch_size=8", "evaluate.max_format_errors=2",
              "model.chat_template=compact"]
    out = {}
    for engine in ("local", "ray"):
        cfg = load_config("params.yaml", overrides=[*common, f"rollout.engine={engine}", "ray.workers=2"])
        res = evaluate.run(cfg, paths, policy=tiny_model_dir, out=str(tmp_path / engine), progress=False)
        out[engine] = res
    a = read_parquet(tmp_path / "local" / f"{out['local']['policy']}.parquet")
    b = read_parquet(tmp_path / "ray" / f"{out['ray']['policy']}.parquet")
    pd.testing.assert_frame_equal(a, b)  # byte-for-byte the same outputs: wall clock lives in .timings.json
    name = out["local"]["policy"]
    ma, mb = (json.loads((tmp_path / e / f"{name}.json").read_text()) for e in ("local", "ray"))
    assert ma == mb and not any("wall" in k for k in ma)


def test_ray_actor_killed_mid_rollout_is_replaced_and_its_shard_rerun(ray_cluster, tmp_path):
    """SIGKILL one actor while it plays its shard: Ray restarts it (the constructor rebuilds the
    policy) and reruns the shard; every episode comes back exactly once, as ``local`` plays it."""
    marker = tmp_path / "acts.log"

    class SlowOracle(OraclePolicy):  # the oracle, slowed so that the kill lands mid-shard
        policy_id = "oracle"

        def act(self, conversations, tools, contexts=None):
            with open(marker, "a") as f:
                f.write(f"{os.getpid()} {len(conversations)}\n")
            time.sleep(0.3)
            return super().act(conversations, tools, contexts=contexts)

    specs = _specs(4)
    local = distributed.run_episodes(specs, OraclePolicy, progress=False)
    killed: list[int] = []

    def kill_first_actor() -> None:
        deadline = time.time() + 120
        while time.time() < deadline:
            if marker.exists() and (lines := marker.read_text().split()):
                pid = int(lines[0])
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_first_actor, daemon=True)
    killer.start()
    sharded = distributed.run_episodes(specs, SlowOracle, engine="ray", progress=False,
                                       ray=RayConfig(workers=2, max_restarts=2))
    killer.join(timeout=5)
    assert killed, "the test never saw an actor act"
    pids = {int(line.split()[0]) for line in marker.read_text().splitlines()}
    assert len(pids) >= 3, f"expected 2 actors + 1 replacement, saw pids {pids}"
    keys = [(t.problem_id, t.sample_idx) for t in sharded]
    assert len(keys) == len(set(keys)) == len(specs)
    assert _transcript(sharded) == _transcript(local)


def test_ray_unreachable_address_fails_fast_naming_the_fix():
    t0 = time.perf_counter()
    with pytest.raises(distributed.RayUnavailable) as e:
        distributed.run_episodes(_specs(1), OraclePolicy, engine="ray", progress=False,
                                 ray=RayConfig(address="127.0.0.1:1", connect_timeout_s=3))
    assert time.perf_counter() - t0 < 10
    msg = str(e.value)
    assert "127.0.0.1:1" in msg and "ray start --head" in msg and "rollout.engine=local" in msg
    with pytest.raises(distributed.RayUnavailable, match="is not 'local', 'auto'"):
        distributed.check_reachable("nonsense", 1)


def test_ray_config_rejects_bad_values_naming_the_key():
    from apprentice.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.engine"):
        load_config("params.yaml", overrides=["rollout.engine=slurm"])
    with pytest.raises(ConfigError, match="ray.workers"):
        load_config("params.yaml", overrides=["ray.workers=0"])


def test_ray_shards_are_contiguous_cover_every_problem_and_never_empty():
    for n in (1, 2, 7, 40):
        for k in (1, 2, 3, 8, 64):
            b = distributed.shard_bounds(n, k)
            assert b[0][0] == 0 and b[-1][1] == n and all(x[1] == y[0] for x, y in zip(b, b[1:], strict=False))
            assert all(e > s for s, e in b) and len(b) == min(k, n)
            assert max(e - s for s, e in b) - min(e - s for s, e in b) <= 1
