"""Outputs tracked by DVC hold no wall-clock values and no mtime-based fingerprints, so two seeded runs
write identical bytes and ``dvc.lock`` can tell a real change from a rerun."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pandas as pd

from apprentice.config import Config
from apprentice.data.trajectories import problems_frame, write_parquet
from apprentice.envs import FAMILIES
from apprentice.paths import Paths
from apprentice.training import common


def _md5(path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def test_stage_fingerprint_follows_content_not_mtime(tmp_path):
    f = tmp_path / "sft.parquet"
    f.write_bytes(b"rows")
    before = common.fingerprint({"a": 1}, [f, tmp_path])
    os.utime(f, (time.time() + 3600, time.time() + 3600))  # a checkout, a copy, a rerun of the producer
    assert common.fingerprint({"a": 1}, [f, tmp_path]) == before
    f.write_bytes(b"ROWS")
    assert common.fingerprint({"a": 1}, [f, tmp_path]) != before


def test_fingerprints_do_not_depend_on_where_the_checkout_is(tmp_path):
    """A clone at another path (a second machine, CI) must stamp the same bytes into its outputs."""
    from apprentice.config import PolicyConfig
    from apprentice.rollout import shards

    stamps, tables = [], []
    for where in ("machine1", "elsewhere/machine2"):
        model = tmp_path / where / "models" / "sft"
        model.mkdir(parents=True)
        (model / "config.json").write_text("{}")
        data = tmp_path / where / "sft.parquet"
        data.write_bytes(b"rows")
        stamps.append(common.fingerprint({"a": 1}, [data, model]))
        problems = pd.DataFrame({"spec": ["{}"]})
        tables.append(shards.fingerprint(problems, PolicyConfig(kind="hf", model=str(model)), Config(),
                                         "apprentice.stages.rollout"))
    assert stamps[0] == stamps[1] and tables[0] == tables[1]


def test_model_folder_metrics_hold_no_wall_clock(tmp_path):
    src = tmp_path / "work.jsonl"
    src.write_text(json.dumps({"stage": "sft", "step": 1, "time": 3.2, "loss": 0.5}) + "\n"
                   + json.dumps({"stage": "sft", "step": 1, "train_runtime": 9.1, "train_loss": 0.5}) + "\n"
                   # TRL's GRPO logs `step_time` (kept, it alone would make two clones' RL folders differ)
                   + json.dumps({"stage": "rl", "step": 1, "step_time": 15.3, "reward": 0.0}) + "\n")
    final = tmp_path / "models" / "sft"
    final.mkdir(parents=True)
    common.split_timings(src, final / common.METRICS_FILE, common.timings_path(final))
    rows = common.read_metrics(final / common.METRICS_FILE)
    assert rows == [{"stage": "sft", "step": 1, "loss": 0.5}, {"stage": "sft", "step": 1, "train_loss": 0.5},
                    {"stage": "rl", "step": 1, "reward": 0.0}]
    timed = common.read_metrics(common.timings_path(final))
    assert [r.get("time", r.get("train_runtime", r.get("step_time"))) for r in timed] == [3.2, 9.1, 15.3]
    assert not any(common.is_wall_clock(k) for k in ("loss", "reward", "completions/mean_length", "entropy"))
    assert common.timings_path(final).parent.name == ".timings"  # beside the output, not in it


def test_two_seeded_evaluations_write_identical_outputs(tmp_path):
    from apprentice.stages import evaluate

    grid = FAMILIES["grid"]
    specs = [grid.make_spec(seed=i, difficulty={"size": 5, "obstacles": 1, "keys": 0, "budget_slack": 2})
             for i in range(4)]
    digests = []
    for run in ("a", "b"):
        paths = Paths(tmp_path / run)
        write_parquet(problems_frame(specs, [0] * 4, split="eval"), paths.eval_problems)
        res = evaluate.run(Config(), paths, policy="oracle", progress=False)
        pq, js = Path(res["episodes"]), Path(res["metrics"])
        assert "wall" not in js.read_text() and float(pd.read_parquet(pq)["wall_s"].sum()) == 0.0
        assert pq.with_suffix(".timings.json").exists()
        digests.append((_md5(pq), _md5(js)))
    assert digests[0] == digests[1]
