"""``kill -9`` of a real teacher-rollout stage halfway through one shard (40 problems, the default
shard size of 64): the rerun plays only the episodes that had not finished, and its table is
byte-identical to an uninterrupted run's.

The stage runs in a subprocess on real grid problems with the real oracle, slowed down per round so
the kill lands mid-shard; the parent watches the shard's journal on disk and sends SIGKILL once
episodes have finished there, as an operator or an OOM killer would. The rerun's policy counts the
episodes it starts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from apprentice.config import Config
from apprentice.data.trajectories import problems_frame, write_parquet
from apprentice.envs import FAMILIES
from apprentice.paths import Paths
from apprentice.policies.oracle import OraclePolicy
from apprentice.rollout import shards

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
ROOT = Path(__file__).resolve().parents[2]
N = 40
SETTINGS = {"rollout": {"shard_size": 64, "teacher": {"kind": "oracle", "batch_size": 4}}}

# The child: the teacher-rollout stage with the oracle, sleeping `delay` s per round, writing one line
# to `counter` per episode it starts (a conversation of system + task only).
_DRIVER = r"""
import sys, time
from pathlib import Path
from apprentice.config import Config
from apprentice.paths import Paths
from apprentice.policies.oracle import OraclePolicy
from apprentice.stages import rollout as stage

root, delay, counter, settings = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3], eval(sys.argv[4])

class Counted(OraclePolicy):
    def act(self, conversations, *a, **k):
        with open(counter, "a") as f:
            f.write("".join(f"{c[1]['content'][:40]!r}\n" for c in conversations if len(c) == 2))
        time.sleep(delay)
        return super().act(conversations, *a, **k)

stage.build_policy = lambda *a, **k: Counted()
stage.run(Config.model_validate(settings), Paths(root), progress=False)
"""


def _problems(root: Path) -> pd.DataFrame:
    grid = FAMILIES["grid"]
    specs = [grid.make_spec(seed=i, difficulty={"size": 4 + i % 4, "obstacles": i % 3, "keys": 0, "budget_slack": 2})
             for i in range(N)]
    df = problems_frame(specs, [0] * N, split="train")
    write_parquet(df, Paths(root).problems)
    return df


def _child(root: Path, delay: float, counter: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _DRIVER, str(root), str(delay), str(counter), repr(SETTINGS)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "APPRENTICE_QUIET": "1"})


def _journal(root: Path) -> Path | None:
    found = list(root.glob("data/iter_1/.teacher.shards-*-64/00000.journal.jsonl"))
    return found[0] if found else None


def test_sigkill_mid_shard_keeps_finished_episodes_and_the_rerun_plays_only_the_rest(tmp_path, monkeypatch):
    from apprentice.stages import rollout as stage

    ref_root, root = tmp_path / "uninterrupted", tmp_path / "killed"
    problems = _problems(ref_root)
    _problems(root)
    monkeypatch.setattr(stage, "build_policy", lambda *a, **k: OraclePolicy())
    reference = Path(stage.run(Config.model_validate(SETTINGS), Paths(ref_root), progress=False)["out"])

    killed = _child(root, 0.05, tmp_path / "killed.count")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and killed.poll() is None:
            j = _journal(root)
            if j is not None and j.read_bytes().count(b"\n") > 10:  # header + ten finished episodes
                break
            time.sleep(0.01)
        assert killed.poll() is None, f"the run ended before the kill:\n{killed.communicate()[1][-3000:]}"
        os.kill(killed.pid, signal.SIGKILL)
    finally:
        killed.kill()
        killed.communicate()
    assert killed.returncode == -signal.SIGKILL
    assert not Paths(root).teacher_trajectories.exists()
    sdir = shards.shard_dir(Paths(root).teacher_trajectories, _fingerprint(root), 64)
    assert not (sdir / "00000.parquet").exists()  # one shard of 64: before the journal, nothing was kept
    kept = shards.read_journal(sdir / "00000.journal.jsonl", _fingerprint(root), 0)
    assert 10 <= len(kept) < N
    assert len({t.problem_id for t in kept}) == len(kept)

    counter = tmp_path / "rerun.count"
    rerun = _child(root, 0.0, counter)
    _, err = rerun.communicate(timeout=120)
    assert rerun.returncode == 0, err[-3000:]
    assert len(counter.read_text().splitlines()) == N - len(kept)  # only the unfinished episodes ran
    out = Paths(root).teacher_trajectories
    assert out.read_bytes() == reference.read_bytes()
    assert list(pd.read_parquet(out)["problem_id"]) == list(problems["problem_id"])
    assert not sdir.exists()  # the journal went with the shard folder once the table was written


def _fingerprint(root: Path) -> str:
    """The fingerprint the stage computes for these inputs (the shard folder and journal carry it)."""
    from apprentice.data.trajectories import read_parquet
    from apprentice.policies.factory import resolve_policy
    from apprentice.stages import rollout as stage

    cfg = Config.model_validate(SETTINGS)
    paths = Paths(root)
    _, pol_cfg = resolve_policy(None, cfg.rollout.teacher, cfg, paths)
    return shards.fingerprint(read_parquet(paths.problems), pol_cfg, cfg, stage.__name__,
                              samples=cfg.rollout.samples_per_problem, max_turns=cfg.rollout.max_turns)
