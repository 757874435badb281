"""Executor policies and schedules of the OPD family, on synthetic numbers (no models)."""

from __future__ import annotations

import pytest

from apprentice.training.opd.executors import (
    STUDENT,
    TEACHER,
    DASHExecutor,
    GuidedExecutor,
    TCODExecutor,
    VanillaExecutor,
    count_switches,
)
from apprentice.training.opd.schedules import DecaySchedule, DepthSchedule


# ---- schedules ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["linear", "cosine", "exponential"])
def test_decay_hits_end_points_and_is_monotone(kind):
    s = DecaySchedule(start=0.8, total_steps=10, kind=kind)
    assert s(0) == pytest.approx(0.8)
    assert s(10) == 0.0 and s(25) == 0.0  # exactly zero, and stays there
    values = [s(t) for t in range(11)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))
    assert 0.0 < s(5) < 0.8


def test_exponential_is_front_loaded_and_cosine_back_loaded():
    lin, cos, exp = (DecaySchedule(1.0, 10, k)(3) for k in ("linear", "cosine", "exponential"))
    assert exp < lin < cos


@pytest.mark.parametrize("kind", ["linear", "stages"])
def test_depth_grows_from_short_to_long(kind):
    d = DepthSchedule(start=1, end=6, total_steps=12, kind=kind)
    depths = [d(t) for t in range(15)]
    assert depths[0] == 1 and d(12) == 6 and d(100) == 6
    assert all(a <= b for a, b in zip(depths, depths[1:], strict=False))
    assert len(set(depths)) >= 3


def test_depth_rejects_shrinking():
    with pytest.raises(ValueError, match="start <= end"):
        DepthSchedule(start=5, end=2, total_steps=3)


# ---- executors ------------------------------------------------------------------------------------
def _run(ex, discrepancies, step=0):
    """Drive an executor over turns with given per-turn discrepancies; return the actors."""
    st = ex.new_episode(0, step)
    for t, d in enumerate(discrepancies):
        actor = ex.act(st, t, step)
        ex.observe(st, actor, d)
    return st


def test_vanilla_student_always_acts():
    st = _run(VanillaExecutor(), [5.0] * 6)
    assert st.actors == [STUDENT] * 6 and st.switches == 0 and st.teacher_share == 0.0


def test_guided_follows_probability_and_is_seeded():
    ex = GuidedExecutor(p=DecaySchedule(0.5, total_steps=10), seed=3)
    shares = [_run(ex, [0.0] * 40, step=0).teacher_share for _ in range(1)]
    many = [ex.new_episode(i, 0) for i in range(200)]
    total = sum(ex.act(s, 0, 0) == TEACHER for s in many)
    assert 70 <= total <= 130, total  # p = 0.5 at step 0
    assert 0.2 < shares[0] < 0.8
    # p reaches 0: the teacher never acts at the end of the schedule
    assert _run(ex, [0.0] * 50, step=10).teacher_share == 0.0
    # same (seed, step, episode) -> same choices
    assert _run(ex, [0.0] * 20, step=2).actors == _run(ex, [0.0] * 20, step=2).actors


def test_dash_transient_spike_does_not_switch():
    ex = DASHExecutor(drift_threshold=0.9, recovery_threshold=0.9, allowance=0.5, scale=1.0)
    st = _run(ex, [0.0, 0.1, 8.0, 0.1, 0.0, 0.1, 8.0, 0.0])  # isolated spikes, calm between
    assert st.actors == [STUDENT] * 8
    assert st.switches == 0


def test_dash_sustained_drift_switches_then_recovery_switches_back():
    ex = DASHExecutor(drift_threshold=0.9, recovery_threshold=0.9, allowance=0.5, scale=1.0)
    # 3 student turns of strong drift, then the teacher acts while it and the student agree
    st = _run(ex, [8.0, 8.0, 8.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert st.actors[:2] == [STUDENT, STUDENT]  # evidence needs two turns to cross 0.9
    assert st.actors[2] == TEACHER  # switched after sustained drift
    assert TEACHER in st.actors and st.actors[-1] == STUDENT  # recovered and handed back
    assert st.switches == 2
    assert count_switches(st.actors) == 2


def test_dash_hysteresis_thresholds_are_separate():
    # easy to hand over, hard to hand back: recovery needs more agreeing teacher turns than drift needed
    ex = DASHExecutor(drift_threshold=0.9, recovery_threshold=2.4, allowance=0.5, scale=1.0)
    st = _run(ex, [8.0, 8.0] + [0.0] * 8)
    first_teacher = st.actors.index(TEACHER)
    back = st.actors.index(STUDENT, first_teacher)
    assert first_teacher == 2 and back - first_teacher == 5  # 0.5 per calm teacher turn -> 5 turns to 2.4
    # a teacher turn where the models disagree carries no recovery evidence: the teacher keeps acting
    st2 = _run(ex, [8.0, 8.0] + [8.0] * 8)
    assert st2.actors[2:] == [TEACHER] * 8


def test_dash_ignores_missing_discrepancy():
    ex = DASHExecutor()
    st = _run(ex, [None, float("nan"), None])
    assert st.actors == [STUDENT] * 3 and st.drift == 0.0


def test_tcod_horizon_grows():
    ex = TCODExecutor(depth=DepthSchedule(1, 5, 8))
    assert ex.horizon(0) == 1 and ex.horizon(8) == 5
    assert _run(ex, [1.0] * 3).actors == [STUDENT] * 3
