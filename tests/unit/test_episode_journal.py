"""Episodes reach disk as they finish: the engine hands each one over (``on_finish``) without
changing its batching or results, the shard runner journals them, and a run that dies mid-shard is
resumed from the journal, playing only the episodes that had not finished, with the same table as an
uninterrupted run. Real grid problems and the real oracle; the "kill" is a BaseException raised from
inside the policy's ``act`` (nothing in the runner catches it, as nothing runs after a SIGKILL; the
subprocess SIGKILL is in tests/integration/test_kill_rollout.py)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from apprentice.data.trajectories import problems_frame, trajectories_frame
from apprentice.envs import FAMILIES
from apprentice.policies.base import Turn
from apprentice.policies.oracle import OraclePolicy
from apprentice.rollout import shards
from apprentice.rollout.episodes import run_episodes

FP = "f" * 64


class Killed(BaseException):
    """What the process would have got from SIGKILL: nothing after it runs."""


class Oracle(OraclePolicy):
    """The oracle, counting the episodes it starts; ``kill_at`` raises :class:`Killed` at that round;
    turns of conversations whose task contains one of ``broken`` fail (an endpoint out of retries)."""

    def __init__(self, kill_at: int = 0, broken: tuple[str, ...] = ()) -> None:
        self.kill_at, self.broken, self.rounds, self.started = kill_at, broken, 0, []

    def act(self, conversations, *args, **kw):
        self.rounds += 1
        if self.rounds == self.kill_at:
            raise Killed
        self.started += [c[1]["content"] for c in conversations if len(c) == 2]
        turns = super().act(conversations, *args, **kw)
        return [Turn(message={"role": "assistant", "content": ""}, error="503 after 3 retries")
                if any(b in c[1]["content"] for b in self.broken) else t
                for c, t in zip(conversations, turns, strict=True)]


def _problems(n: int) -> pd.DataFrame:
    grid = FAMILIES["grid"]
    specs = [grid.make_spec(seed=i, difficulty={"size": 4 + i % 5, "obstacles": i % 3, "keys": 0, "budget_slack": 2})
             for i in range(n)]
    return problems_frame(specs, [i % 2 for i in range(n)], split="train")


def _rows(trajs) -> list[dict]:
    return [{k: v for k, v in t.to_row().items() if k != "wall_s"} for t in trajs]


# -- the engine's callback ---------------------------------------------------------------------------

@pytest.mark.parametrize(("batch_size", "samples"), [(3, 1), (2, 2), (64, 1)])
def test_on_finish_hands_over_every_episode_once_as_it_finishes(batch_size, samples):
    problems = _problems(9)
    seen = []
    pol = Oracle()
    got = run_episodes(problems, pol, batch_size=batch_size, samples_per_problem=samples, progress=False,
                       on_finish=lambda t: seen.append((pol.rounds, t)))
    plain = run_episodes(problems, Oracle(), batch_size=batch_size, samples_per_problem=samples, progress=False)
    assert _rows(got) == _rows(plain)  # the callback changes neither batching nor results
    by_key = {(t.problem_id, t.sample_idx): t.to_row() for t in got}
    assert len(seen) == len(by_key)
    assert {(t.problem_id, t.sample_idx): t.to_row() for _, t in seen} == by_key  # wall_s too: the same episode
    for rounds, t in seen:  # handed over in the round it finished, not when the batch ends
        assert rounds >= t.turns and (rounds == t.turns or batch_size * samples < len(got))
    assert seen[0][0] < pol.rounds


def test_on_finish_gets_failed_episodes_and_episodes_a_replayed_start_finished():
    problems = _problems(4)
    task = FAMILIES["grid"]().reset(spec=problems["spec"].iloc[1])
    seen = []
    got = run_episodes(problems, Oracle(broken=(task,)), progress=False, on_finish=seen.append)
    assert sorted(t.problem_id for t in seen) == sorted(problems["problem_id"])
    assert [t.extra.get("failed", False) for t in got] == [False, True, False, False]
    assert {t.problem_id for t in seen if t.extra.get("failed")} == {problems["problem_id"].iloc[1]}

    solved = [[m for m in json.loads(r["messages"]) if m["role"] == "assistant"] for r in _rows(got)]
    seen, pol = [], Oracle()
    replayed = run_episodes(problems.iloc[[0, 2]], pol, starts=[solved[0], solved[2]], progress=False,
                            on_finish=seen.append)
    assert pol.rounds == 0 and all(t.success for t in replayed)
    assert [t.problem_id for t in seen] == [t.problem_id for t in replayed]


@pytest.mark.parametrize("batch_size", [2, 64])
def test_skip_leaves_out_exactly_the_saved_episodes(batch_size):
    problems = _problems(5)
    ids = list(problems["problem_id"])
    full = run_episodes(problems, Oracle(), samples_per_problem=3, batch_size=batch_size, progress=False)
    skip = {(ids[0], 0), (ids[0], 1), (ids[0], 2), (ids[2], 1), (ids[4], 0)}
    pol = Oracle()
    rest = run_episodes(problems, pol, samples_per_problem=3, batch_size=batch_size, progress=False, skip=skip)
    assert len(pol.started) == 15 - len(skip)
    assert _rows(rest) == _rows(t for t in full if (t.problem_id, t.sample_idx) not in skip)


# -- the shard journal -----------------------------------------------------------------------------

def _chunk(pol, **kw):
    def chunk(rows, seed, **resume):  # as the stages pass run_sharded's keywords on to the engine
        return run_episodes(rows, pol, seed=seed, progress=False, **resume, **kw)
    return chunk


def _run(tmp_path, problems, pol, shard_size=64, samples=1, **kw):
    return shards.run_sharded(problems, _chunk(pol, samples_per_problem=samples, **kw), tmp_path / "teacher.parquet",
                              FP, samples=samples, policy_id="oracle", shard_size=shard_size)


def _journal(tmp_path, shard=0, shard_size=64):
    return shards.shard_dir(tmp_path / "teacher.parquet", FP, shard_size) / f"{shard:05d}.journal.jsonl"


def _stripped(df: pd.DataFrame) -> pd.DataFrame:
    return shards.without_wall_clock(df)


@pytest.mark.parametrize(("shard_size", "samples", "kill_at"), [(64, 1, 13), (64, 2, 22), (5, 1, 16)])
def test_a_run_killed_mid_shard_resumes_from_the_journal(tmp_path, shard_size, samples, kill_at):
    problems = _problems(12)
    reference, _ = _run(tmp_path / "ref", problems, Oracle(), shard_size, samples, batch_size=3)
    killed = Oracle(kill_at=kill_at)
    with pytest.raises(Killed):
        _run(tmp_path, problems, killed, shard_size, samples, batch_size=3)
    shard = 0 if shard_size == 64 else 1  # shard size 5: the first shard finished, the kill hits the second
    kept = shards.read_journal(_journal(tmp_path, shard, shard_size), FP, shard)
    assert 0 < len(kept) < len(problems) * samples
    assert not any(t.extra.get("error") for t in kept)

    again = Oracle()
    table, counts = _run(tmp_path, problems, again, shard_size, samples, batch_size=3)
    saved = shard * shard_size * samples + len(kept)
    assert len(again.started) == len(problems) * samples - saved  # only what had not finished
    pd.testing.assert_frame_equal(_stripped(table), _stripped(reference))
    assert counts["shards_reused"] == shard
    assert not _journal(tmp_path, shard, shard_size).exists()


def test_failed_episodes_are_not_journaled_and_a_rerun_plays_them(tmp_path):
    problems = _problems(8)
    task = FAMILIES["grid"]().reset(spec=problems["spec"].iloc[0])
    with pytest.raises(Killed):
        _run(tmp_path, problems, Oracle(kill_at=12, broken=(task,)), batch_size=2)
    kept = shards.read_journal(_journal(tmp_path), FP, 0)
    assert problems["problem_id"].iloc[0] not in {t.problem_id for t in kept} and kept
    again = Oracle()
    table, _ = _run(tmp_path, problems, again, batch_size=2)
    assert len(again.started) == len(problems) - len(kept) and task in again.started
    assert table["success"].all()


def test_a_cut_off_last_line_is_dropped_and_the_rest_kept(tmp_path):
    problems = _problems(6)
    with pytest.raises(Killed):
        _run(tmp_path, problems, Oracle(kill_at=9), batch_size=2)
    path = _journal(tmp_path)
    whole = shards.read_journal(path, FP, 0)
    assert len(whole) >= 2
    data = path.read_bytes()
    path.write_bytes(data[:-len(data.split(b"\n")[-2]) // 2 - 1])  # the last episode half written
    assert [t.to_row() for t in shards.read_journal(path, FP, 0)] == [t.to_row() for t in whole[:-1]]
    again = Oracle()
    table, _ = _run(tmp_path, problems, again, batch_size=2)
    assert len(again.started) == len(problems) - len(whole) + 1
    assert len(table) == len(problems) and table["success"].all()


@pytest.mark.parametrize("header", [{"fingerprint": "0" * 64, "shard": 0}, {"fingerprint": FP, "shard": 3},
                                    "not json", ""])
def test_a_journal_of_other_inputs_is_ignored(tmp_path, header):
    problems = _problems(5)
    with pytest.raises(Killed):
        _run(tmp_path, problems, Oracle(kill_at=6), batch_size=2)
    path = _journal(tmp_path)
    lines = path.read_bytes().split(b"\n")
    assert len(lines) > 2
    head = header if isinstance(header, str) else json.dumps(header)
    path.write_bytes(b"\n".join([head.encode(), *lines[1:]]))
    assert shards.read_journal(path, FP, 0) == []
    again = Oracle()
    _run(tmp_path, problems, again, batch_size=2)
    assert len(again.started) == len(problems)  # everything ran again


def test_a_chunk_without_on_finish_keeps_shard_granularity(tmp_path):
    problems = _problems(6)
    pol = Oracle()

    def chunk(rows, seed):
        assert not _journal(tmp_path).exists()
        return run_episodes(rows, pol, seed=seed, progress=False, batch_size=2)

    table, _ = shards.run_sharded(problems, chunk, tmp_path / "teacher.parquet", FP, samples=1, policy_id="oracle")
    assert len(table) == 6 and not _journal(tmp_path).exists()


def test_journal_rows_round_trip_exactly(tmp_path):
    problems = _problems(3)
    trajs = run_episodes(problems, Oracle(), progress=False)
    trajs[0].messages[0]["content"] += " caf\u00e9 \ud83d\ude00 \u2028 \"quoted\"\n"  # any text survives
    trajs[1].extra["score"] = 0.1 + 0.2
    path = tmp_path / "j.jsonl"
    journal = shards._Journal(path, FP, 0, {(t.problem_id, t.sample_idx) for t in trajs})
    for t in trajs:
        journal.append(t)
        assert len(shards.read_journal(path, FP, 0)) == trajs.index(t) + 1  # on disk before close
    journal.close()
    back = shards.read_journal(path, FP, 0)
    pd.testing.assert_frame_equal(trajectories_frame(back), trajectories_frame(trajs))
