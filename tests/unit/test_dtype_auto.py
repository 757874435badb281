"""``dtype: auto`` on a CPU is decided by a measurement, cached per machine, overridable."""

from __future__ import annotations

import json

import pytest

from apprentice.lm import dtypes


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("APPRENTICE_CACHE", str(tmp_path))
    monkeypatch.delenv("APPRENTICE_AUTO_DTYPE", raising=False)
    dtypes.cpu_auto.cache_clear()
    yield tmp_path
    dtypes.cpu_auto.cache_clear()


def test_the_probe_measures_both_dtypes_and_bf16_rounding_is_within_tolerance():
    speedup, err = dtypes.measure(reps=1)
    assert speedup > 0
    assert 1e-4 < err < dtypes.MAX_REL_ERROR  # bf16 rounds (not 0), but only at its ~3 significant digits


@pytest.mark.parametrize(("speedup", "err", "want"), [
    (2.5, 4e-3, "bf16"),  # AMX: faster and accurate
    (0.6, 4e-3, "fp32"),  # AVX2: bf16 autocast is emulated, slower
    (1.1, 4e-3, "fp32"),  # inside the noise margin: not worth a different numeric path
    (3.0, 0.5, "fp32"),  # fast but wrong (a broken kernel): never
])
def test_auto_picks_bf16_only_when_faster_by_the_margin_and_accurate(fresh, monkeypatch, speedup, err, want):
    monkeypatch.setattr(dtypes, "measure", lambda reps=3: (speedup, err))
    probe = dtypes.cpu_auto()
    assert (probe.dtype, probe.source) == (want, "measured")
    assert want in probe.line() and f"{dtypes.MIN_SPEEDUP}x" in probe.line()


def test_the_decision_is_cached_per_machine_so_every_stage_resolves_the_same(fresh, monkeypatch):
    monkeypatch.setattr(dtypes, "measure", lambda reps=3: (2.0, 4e-3))
    first = dtypes.cpu_auto()
    dtypes.cpu_auto.cache_clear()
    monkeypatch.setattr(dtypes, "measure", lambda reps=3: pytest.fail("measured twice"))
    again = dtypes.cpu_auto()
    assert (again.dtype, again.source) == (first.dtype, "cache")
    stored = json.loads((fresh / "dtype-auto.json").read_text())
    assert list(stored) == [dtypes.machine_key()] and stored[dtypes.machine_key()]["dtype"] == "bf16"


def test_a_corrupt_cache_is_remeasured_and_the_env_overrides(fresh, monkeypatch):
    (fresh / "dtype-auto.json").write_text("{not json")
    monkeypatch.setattr(dtypes, "measure", lambda reps=3: (0.5, 4e-3))
    assert dtypes.cpu_auto().dtype == "fp32"
    dtypes.cpu_auto.cache_clear()
    monkeypatch.setenv("APPRENTICE_AUTO_DTYPE", "bf16")
    assert (dtypes.cpu_auto().dtype, dtypes.cpu_auto().source) == ("bf16", "env")
    dtypes.cpu_auto.cache_clear()
    monkeypatch.setenv("APPRENTICE_AUTO_DTYPE", "fp16")
    with pytest.raises(ValueError, match="'bf16' or 'fp32'"):
        dtypes.cpu_auto()


def test_the_probe_runs_on_one_thread_and_restores_the_thread_count():
    """One thread timed by its own CPU time: a descheduled sibling thread cannot stall it (an
    all-threads wall-clock probe can cache fp32 on an AMX machine whose cores other work keeps busy)."""
    import torch

    before = torch.get_num_threads()
    seen = []
    real = dtypes._rounds

    def spy(timed, reps):
        seen.append(torch.get_num_threads())
        return real(timed, reps)

    dtypes._rounds = spy
    try:
        dtypes.measure(reps=1)
    finally:
        dtypes._rounds = real
    assert seen == [1] and torch.get_num_threads() == before


def test_a_decision_cached_by_an_older_probe_is_measured_again():
    assert f"probe:{dtypes.PROBE_VERSION}" in dtypes.machine_key() and dtypes.PROBE_VERSION >= 2
