"""Curriculum order, the pass-rate filter and the generation scheduler (pure functions over tables)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from apprentice.curriculum import (
    GenerationScheduler,
    PassRate,
    filter_summary,
    order_by_difficulty,
    pass_rate_filter,
    pass_rates,
)


def _problems(rows):
    return pd.DataFrame([{"problem_id": pid, "level": lv, "difficulty": json.dumps(d)} for pid, lv, d in rows])


def test_order_is_level_then_difficulty_sum_then_id():
    df = _problems([
        ("p_hard", 2, {"a": 0, "b": 0}),
        ("p_mid_big", 1, {"a": 3, "b": 3}),
        ("p_mid_small", 1, {"a": 1, "b": 0}),
        ("p_easy_b", 0, {"a": 1, "b": 1}),
        ("p_easy_a", 0, {"a": 2, "b": 0}),
    ])
    assert order_by_difficulty(df)["problem_id"].tolist() == [
        "p_easy_a", "p_easy_b", "p_mid_small", "p_mid_big", "p_hard"]
    # deterministic whatever the input order
    shuffled = df.sample(frac=1.0, random_state=3)
    assert order_by_difficulty(shuffled)["problem_id"].tolist() == order_by_difficulty(df)["problem_id"].tolist()


def test_pass_rates_aggregate_episodes_per_problem():
    table = pass_rates(["a", "a", "a", "b", "b"], [True, False, True, False, False])
    assert table["a"] == PassRate(2, 3) and table["a"].rate == pytest.approx(2 / 3)
    assert table["b"] == PassRate(0, 2)


def test_filter_drops_always_and_never_solved_and_keeps_order():
    ordered = ["solved", "mixed1", "never", "mixed2", "unprobed"]
    table = {"solved": PassRate(4, 4), "mixed1": PassRate(1, 4), "never": PassRate(0, 4), "mixed2": PassRate(3, 4)}
    kept = pass_rate_filter(ordered, table)
    assert kept == ["mixed1", "mixed2", "unprobed"]
    s = filter_summary(ordered, table, kept)
    assert (s["probed"], s["always_solved"], s["never_solved"], s["kept"]) == (4, 1, 1, 3)


def test_filter_falls_back_to_unfiltered_when_nothing_is_informative():
    ordered = ["a", "b"]
    with pytest.warns(UserWarning, match="always or never solved"):
        assert pass_rate_filter(ordered, {"a": PassRate(0, 2), "b": PassRate(2, 2)}) == ordered


def test_band_first_then_unprobed_by_their_strata_pass_rate():
    from apprentice.curriculum import PassRate, band_first

    table = {"a": PassRate(4, 4), "b": PassRate(2, 4), "c": PassRate(0, 4)}  # a: easy, b: band, c: hard
    strata = {"a": "easy", "b": "mid", "c": "hard", "x": "easy", "y": "mid", "z": "hard", "w": "unknown"}
    kept = ["a", "x", "y", "b", "z", "w"]
    assert band_first(kept, table, strata) == ["b", "y", "x", "z", "a", "w"]  # y: its stratum is at 0.5
    assert band_first(kept, table) == ["b", "a", "x", "y", "z", "w"]  # without strata: order kept


def test_scheduler_advances_on_threshold_and_stops_at_last():
    s = GenerationScheduler(3, 0.6)
    assert [s.observe(p) for p in (0.2, 0.59, 0.6, 0.9, 0.95, 0.1)] == [0, 0, 1, 2, 2, 2]
    assert GenerationScheduler.from_state(json.loads(json.dumps(s.state_dict()))).current == 2


def test_synthesis_fingerprints_exactly_the_settings_a_sampler_reads():
    """``SAMPLER_SETTINGS`` is what ``sample`` passes to a sampler and what synthesis fingerprints: every
    curriculum key but the sampler's name (synthesis takes ``synth.sampler``), the scheduler's threshold
    and the evolve section."""
    from apprentice.config import CurriculumConfig
    from apprentice.curriculum import SAMPLER_SETTINGS

    assert set(CurriculumConfig.model_fields) - set(SAMPLER_SETTINGS) == {"sampler", "advance_threshold", "evolve"}


def test_dvc_tracks_the_sampler_settings_synthesis_reads():
    """The registry (pandas-free, so it does not import the package) names synth's sampler keys itself;
    they must be the ones synthesis fingerprints, or DVC would miss a change that reselects problems."""
    from apprentice import pipeline
    from apprentice.curriculum import SAMPLER_SETTINGS

    keys = {k.removeprefix("curriculum.") for k in pipeline.get("synth").params if k.startswith("curriculum.")}
    assert keys == set(SAMPLER_SETTINGS)


def test_callers_import_the_curriculum_only_through_its_package():
    """One entry point per decision: outside ``apprentice/curriculum/`` no module names a submodule of
    the package (``apprentice.curriculum.filter`` ...), nor the two modules it replaced. The ex-ante
    difficulty predictor (``curriculum.difficulty``) is a model the synthesis sampler fits, not a
    decision, and is imported by name."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    bad = re.compile(r"apprentice\.curriculum\.(?!difficulty\b)\w+\s+import|from apprentice\.curriculum\.(?!difficulty\b)|"
                     r"apprentice\.samplers\b|training\.curriculum\b|from apprentice\.training import curriculum")
    files = [p for d in ("apprentice", "bench", "experiments", "tests", "tasks", "flows") for p in sorted((root / d).rglob("*.py"))
             if p.parent != root / "apprentice" / "curriculum" and p != Path(__file__).resolve()]
    offenders = [f"{p.relative_to(root)}:{i}" for p in files
                 for i, line in enumerate(p.read_text().splitlines(), 1) if bad.search(line)]
    assert not offenders, offenders
