"""Episodes are flushed in shards: a failure keeps finished work, a rerun runs only what is missing,
failed episodes carry their error, and an unwritable output is found before any episode runs.
Real grid problems and the real oracle; the "endpoint" that fails is the oracle behind a switch."""

from __future__ import annotations

import pandas as pd
import pytest

from apprentice.config import Config
from apprentice.data.trajectories import problems_frame, write_parquet
from apprentice.envs import FAMILIES
from apprentice.paths import Paths
from apprentice.policies.base import Turn
from apprentice.policies.oracle import OraclePolicy
from apprentice.rollout import shards


class FlakyEndpoint(OraclePolicy):
    """The oracle, except that the turns of conversations about ``broken`` problems fail the way an
    endpoint's request fails after its retries (``Turn.error``: only that episode fails)."""

    def __init__(self, broken: set[str]) -> None:
        self.broken, self.calls = broken, 0

    def act(self, conversations, *args, **kw):
        self.calls += len(conversations)
        turns = super().act(conversations, *args, **kw)
        return [Turn(message={"role": "assistant", "content": ""}, error="teacher endpoint: 503 after 3 retries")
                if any(b in str(conv[1]["content"]) for b in self.broken) else t
                for conv, t in zip(conversations, turns, strict=True)]


class CrashingPolicy(OraclePolicy):
    """The oracle, except that ``act`` raises for any batch holding a ``broken`` problem (a bug)."""

    def __init__(self, broken: set[str]) -> None:
        self.broken, self.crashes = broken, 0

    def act(self, conversations, *args, **kw):
        if any(b in str(c[1]["content"]) for c in conversations for b in self.broken):
            self.crashes += 1
            raise RuntimeError("policy crashed")
        return super().act(conversations, *args, **kw)


def _problems(paths: Paths, n: int = 6) -> pd.DataFrame:
    grid = FAMILIES["grid"]
    specs = [grid.make_spec(seed=i, difficulty={"size": 4 + i, "obstacles": i % 3, "keys": 0, "budget_slack": 2})
             for i in range(n)]
    df = problems_frame(specs, [0] * n, split="train")
    write_parquet(df, paths.problems)
    return df


def _unique_task(df: pd.DataFrame, i: int) -> str:
    """Problem ``i``'s task text, which no other problem's task contains (what the endpoint fails on)."""
    texts = [FAMILIES["grid"]().reset(spec=s) for s in df["spec"]]
    assert sum(texts[i] in t for t in texts) == 1, "pick problems with distinct task texts"
    return texts[i]


def _run(paths, pol, monkeypatch, **rollout):
    from apprentice.stages import rollout as stage

    monkeypatch.setattr(stage, "build_policy", lambda *a, **k: pol)
    cfg = Config.model_validate({"rollout": {"shard_size": 2, **rollout}})
    return stage.run(cfg, paths, progress=False)


def test_failed_requests_keep_finished_shards_and_a_rerun_runs_only_the_rest(tmp_path, monkeypatch):
    paths = Paths(tmp_path)
    df = _problems(paths)
    flaky = FlakyEndpoint({_unique_task(df, 4)})
    with pytest.raises(shards.EpisodesFailed, match=r"(?s)1 of 6 episodes failed .*problem "
                       rf"{df['problem_id'].iloc[4]} \(family grid, level 0\): teacher endpoint: 503 after 3 retries"):
        _run(paths, flaky, monkeypatch)
    assert not paths.teacher_trajectories.exists()
    saved = sorted(tmp_path.glob("data/iter_1/.teacher.shards-*/*.parquet"))
    assert [len(pd.read_parquet(p)) for p in saved] == [2, 2, 1]  # shard 3 keeps its finished episode

    healthy = FlakyEndpoint(set())
    out = _run(paths, healthy, monkeypatch)
    assert out["episodes"] == 6 and out["success_rate"] == 1.0
    table = pd.read_parquet(out["out"])
    assert list(table["problem_id"]) == list(df["problem_id"])  # in problem order
    from apprentice.rollout.episodes import run_episodes

    alone = FlakyEndpoint(set())
    run_episodes(df.iloc[4:5], alone, progress=False)
    assert healthy.calls == alone.calls  # only the unfinished problem ran again
    assert not list(tmp_path.glob("data/iter_1/.teacher.shards-*"))  # cleaned once complete


def test_error_budget_records_failed_episodes_with_their_error(tmp_path, monkeypatch):
    paths = Paths(tmp_path)
    df = _problems(paths)
    out = _run(paths, FlakyEndpoint({_unique_task(df, 0)}), monkeypatch, error_budget=0.2)
    table = pd.read_parquet(out["out"])
    assert len(table) == 6 and table["success"].sum() == 5
    assert shards.failures(table) == ["teacher endpoint: 503 after 3 retries"]
    assert list(shards.failed_mask(table)) == [True] + [False] * 5


def test_a_crashing_batch_fails_its_problems_without_a_serial_replay(tmp_path, monkeypatch):
    paths = Paths(tmp_path)
    df = _problems(paths)
    pol = CrashingPolicy({_unique_task(df, 4)})
    with pytest.raises(shards.EpisodesFailed, match=r"(?s)2 of 6 episodes failed.*RuntimeError: policy crashed"):
        _run(paths, pol, monkeypatch)
    assert pol.crashes == 1 + shards.REPLAYS  # once per pass: its problems were not replayed one by one
    assert len(pd.read_parquet(next(tmp_path.glob("data/iter_1/.teacher.shards-*/00001.parquet")))) == 2


def test_unwritable_output_fails_before_any_episode(tmp_path, monkeypatch):
    paths = Paths(tmp_path)
    _problems(paths)
    blocker = tmp_path / "file"
    blocker.write_text("")
    pol = FlakyEndpoint(set())
    from apprentice.stages import rollout as stage

    monkeypatch.setattr(stage, "build_policy", lambda *a, **k: pol)
    with pytest.raises(PermissionError, match="is not writable"):
        stage.run(Config(), paths, out=str(blocker / "teacher.parquet"), progress=False)
    assert pol.calls == 0
