"""The engine's plans: the chunked prefill (every row's new tokens run exactly once, by a chunk that
has it) and the decode groups (each row's columns read by its group)."""

from __future__ import annotations

import random

import pytest

from apprentice.policies.hf_cached import GROUP_COST, decode_groups, prefill_plan


def _padded(new, plan):
    return sum((b - a) * (len(new) if rows is None else len(rows)) for a, b, rows in plan)


@pytest.mark.parametrize("seed", range(20))
def test_every_new_token_runs_once_and_the_last_chunk_is_every_row(seed):
    rng = random.Random(seed)
    new = [rng.choice([1, 5, 30, 72, 73, 113]) + rng.randint(0, 3) for _ in range(rng.randint(1, 40))]
    width = max(new)
    plan = prefill_plan(new, width)
    assert plan[0][0] == 0 and plan[-1][1] == width and plan[-1][2] is None
    assert all(plan[k][1] == plan[k + 1][0] for k in range(len(plan) - 1))  # contiguous, left to right
    for i, n in enumerate(new):  # row i's tokens are the last n columns: each is in a chunk that runs row i
        for col in range(width - n, width):
            (a, b, rows), = [c for c in plan if c[0] <= col < c[1]]
            assert rows is None or i in rows
    assert _padded(new, plan) <= len(new) * width  # never more token-rows than one padded call


def test_one_long_observation_does_not_pad_the_whole_batch():
    """A batch shape the rollout benchmark produces (bench/rollout.py, turn 2): 63 rows of 73 new tokens
    and one of 113; the long row's first 40 tokens run alone, so the other 63 are not padded to 113."""
    new = [73] * 63 + [113]
    plan = prefill_plan(new, 113)
    assert plan == [(0, 40, [63]), (40, 113, None)]
    assert _padded(new, plan) < 0.66 * len(new) * 113


def test_equal_lengths_are_one_call():
    assert prefill_plan([7, 7, 7], 7) == [(0, 7, None)]


def test_decode_groups_cut_where_rows_start_far_apart():
    assert decode_groups([0, 0, 5, 5], 100) == [(0, 4, 0)]  # a few columns saved: not worth a group
    far = decode_groups([0, 0, 1000, 1000, 1000], 1200)
    assert far == [(0, 2, 0), (2, 5, 1000)]
    cost = sum((b - a) * (1200 - s) + GROUP_COST for a, b, s in far)
    assert cost < 5 * 1200 + GROUP_COST  # cheaper than one group over every column


@pytest.mark.parametrize("seed", range(20))
def test_decode_groups_cover_every_row_once_from_its_first_column_and_beat_one_group(seed):
    rng = random.Random(seed)
    starts = sorted(rng.choice([0, 30, 400, 900, 1500]) + rng.randint(0, 20) for _ in range(rng.randint(1, 64)))
    end = 1600
    plan = decode_groups(starts, end)
    assert [a for a, _, _ in plan] == [0] + [b for _, b, _ in plan[:-1]] and plan[-1][1] == len(starts)
    assert all(s == starts[a] and s <= starts[i] for a, b, s in plan for i in range(a, b))
    cost = sum((b - a) * (end - s) + GROUP_COST for a, b, s in plan)
    assert cost <= len(starts) * (end - starts[0]) + GROUP_COST
