"""Each curriculum sampler returns what its definition says on synthetic pass-rate tables."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from apprentice.config import CurriculumConfig
from apprentice.curriculum import SAMPLERS, aes, dtac, hdc, pass_band, pass_table, sample


def _table(rates, attempts=8, **cols):
    df = pd.DataFrame({"problem_id": [f"p{i:02d}" for i in range(len(rates))], "pass_rate": rates,
                       "attempts": attempts})
    for k, v in cols.items():
        df[k] = v
    return df


def test_pass_band_keeps_the_band_closest_first():
    t = _table([0.0, 0.1, 0.4, 0.5, 0.55, 0.8, 1.0, np.nan])
    ids = pass_band(t, p_star=0.5, band=0.2)
    assert ids == ["p03", "p04", "p02"]  # |0|, |.05|, |.1|; 0.8 (.3) is outside, NaN unprobed
    assert pass_band(t, 1, p_star=0.5, band=0.2) == ["p03"]
    assert set(pass_band(t, p_star=0.9, band=0.1)) == {"p05", "p06"}  # equidistant: order by seeded hash


def test_dtac_mixes_pools_in_the_configured_shares():
    rates = [0.0] * 10 + [0.125] * 10 + [0.5] * 20 + [1.0] * 10
    t = _table(rates)
    ids = dtac(t, 20, replay_share=0.25, infeasible_share=0.1, hard_threshold=0.25, easy_threshold=0.9)
    got = t.set_index("problem_id").loc[ids, "pass_rate"]
    assert len(ids) == 20 == len(set(ids))
    assert (got == 0.0).sum() == 2  # infeasible: round(20 * 0.1)
    assert (got == 0.125).sum() == 5  # hard-won replay: round(20 * 0.25)
    assert (got == 0.5).sum() == 13  # learnable: the rest
    assert (got == 1.0).sum() == 0  # mastered never chosen
    # interleaved: the first half already carries both minority pools
    first = set(got.iloc[:10])
    assert {0.0, 0.125, 0.5} <= first


def test_dtac_infeasible_needs_enough_attempts_and_short_pools_are_topped_up():
    t = _table([0.0, 0.0, 0.5, 0.6, 0.7], attempts=[1, 4, 4, 4, 4])
    ids = dtac(t, 4, replay_share=0.5, infeasible_share=0.5, min_attempts=2)
    # one infeasible with >=2 attempts (p01); p00 tried once is not evidence; no hard-won -> learnable tops up
    assert "p00" not in ids and "p01" in ids
    assert sorted(ids) == ["p01", "p02", "p03", "p04"]


def test_hdc_weakens_harness_before_growing_state():
    state = [1, 0, 0, 1, 0, 2]
    harness = [0, 2, 0, 1, 1, 0]
    t = _table([0.5, 0.5, 0.5, 0.5, 0.5, 0.95], state=state, harness=harness, horizon=0)
    ids = hdc(t)
    assert ids == ["p02", "p04", "p01", "p00", "p03"]  # (s0,h0) (s0,h1) (s0,h2) (s1,h0) (s1,h1); p05 mastered
    pairs = [(state[int(i[1:])], harness[int(i[1:])]) for i in ids]
    assert pairs == sorted(pairs)


def test_hdc_without_direction_columns_says_how_to_fix():
    with pytest.raises(ValueError, match="pass_table"):
        hdc(_table([0.5]))


def test_aes_covers_abilities_before_adding_count():
    # eight problems share ability A; one each of B, C, D
    abil = [["A"]] * 8 + [["B"], ["C"], ["A", "D"]]
    t = _table([0.5] * 8 + [0.1, 0.9 - 0.01, 0.2], abilities=[json.dumps(a) for a in abil])
    ids = aes(t, 4)
    covered = set().union(*(set(abil[int(i[1:])]) for i in ids))
    assert covered == {"A", "B", "C", "D"}  # 4 picks cover all 4 abilities
    assert ids[0] == "p10"  # the only problem adding two abilities goes first
    # the second round restarts coverage: picks 5.. are the remaining A problems, closest to p* first
    assert len(aes(t, 11)) == 11


def test_sample_dispatches_on_config_and_every_sampler_is_registered():
    assert set(SAMPLERS) == {"pass_band", "dtac", "hdc", "aes"}
    t = _table([0.5, 0.2, 0.0], attempts=4, state=0, harness=0, horizon=0, abilities=[["a"], ["b"], ["c"]])
    for name in SAMPLERS:
        ids = sample(t, 2, CurriculumConfig(sampler=name))
        assert 1 <= len(ids) <= 3 and set(ids) <= set(t["problem_id"])


def test_pass_table_from_trajectories():
    from apprentice.envs.store import StoreEnv

    specs = [StoreEnv.generate(i, i % 3) for i in range(3)]
    traj = pd.DataFrame({"problem_id": [s.problem_id for s in specs for _ in range(2)],
                         "spec": [s.to_json() for s in specs for _ in range(2)],
                         "success": [True, False, True, True, False, False]})
    t = pass_table(traj)
    assert list(t.sort_values("problem_id")["pass_rate"]) == list(
        t.set_index("problem_id").loc[sorted(t["problem_id"]), "pass_rate"])
    assert dict(zip(t["problem_id"], t["pass_rate"], strict=True))[specs[1].problem_id] == 1.0
    assert {"horizon", "state", "harness", "abilities"} <= set(t)
    assert all(any(a.startswith("tool:store.") for a in ab) for ab in t["abilities"])


def test_order_problems_returns_problem_rows_in_sampler_order():
    from apprentice.curriculum import order_problems

    t = _table([0.5, 0.45, 0.0, 1.0])
    problems = pd.DataFrame({"problem_id": list(t["problem_id"])[::-1], "spec": ["{}"] * 4})
    out = order_problems(problems, t, CurriculumConfig(sampler="pass_band", band=0.2))
    assert list(out["problem_id"]) == ["p00", "p01"]
    with pytest.raises(ValueError, match="not in the problems frame"):
        order_problems(problems.iloc[:1], t, CurriculumConfig(sampler="pass_band", band=0.2))


def test_table_from_rl_probe_rates():
    from apprentice.curriculum import PassRate, table_from_rates
    from apprentice.envs.store import StoreEnv

    specs = [StoreEnv.generate(i, i) for i in range(3)]
    problems = pd.DataFrame({"problem_id": [s.problem_id for s in specs], "spec": [s.to_json() for s in specs]})
    rates = {specs[0].problem_id: PassRate(1, 4), specs[2].problem_id: PassRate(0, 4)}
    t = table_from_rates(rates, problems).set_index("problem_id")
    assert set(t.index) == {specs[0].problem_id, specs[2].problem_id}  # unprobed problem left out
    assert t.loc[specs[0].problem_id, "pass_rate"] == 0.25 and t.loc[specs[2].problem_id, "attempts"] == 4
    assert hdc(t.reset_index())[0] == specs[0].problem_id  # level 0 (smallest state) first
