"""Evolution operators raise the difficulty vector and keep problems solvable; stage.

The generation scheduler is curriculum: tests/unit/test_curriculum.py."""

from __future__ import annotations

import json
import random

import pytest

from apprentice.config import Config
from apprentice.envs import FAMILIES
from apprentice.envs.evolve import (
    DIRECTION_NAMES,
    direction_scores,
    evolve_generation,
    evolve_spec,
    hardness,
    noisy_oracle_episode,
    solvable,
)
from apprentice.paths import Paths

FAMS = [f for f in ("store", "grid", "search") if f in FAMILIES]


def _raised(before: dict, after: dict) -> bool:
    return all(after[k] >= before[k] for k in before) and any(after[k] > before[k] for k in before)


@pytest.mark.parametrize("family", FAMS)
@pytest.mark.parametrize("direction", DIRECTION_NAMES)
def test_operator_raises_difficulty_and_keeps_solvable(family, direction):
    cls = FAMILIES[family]
    moved = 0
    for seed in range(6):
        spec = cls.generate(seed, seed % 2)
        new = evolve_spec(spec, direction)
        if new is None:
            continue
        moved += 1
        assert solvable(new), new
        assert _raised(hardness(spec), hardness(new)), (spec.difficulty, new.difficulty)
        assert direction_scores(new)[direction] == direction_scores(spec)[direction] + 1
        assert new.generation == spec.generation + 1
        assert new.extra["parent"] == spec.problem_id and new.extra["operator"] == direction
    assert moved >= 4, f"{family}/{direction}: operator rarely applies ({moved}/6)"


def test_saturated_direction_returns_none():
    cls = FAMILIES["store"]
    hard = cls.make_spec(3, {"ops": 6, "scale": 3, "lookups": 2, "distractors": 3, "harness": 2})
    assert all(evolve_spec(hard, d) is None for d in DIRECTION_NAMES)
    with pytest.raises(ValueError, match="choose from"):
        evolve_spec(hard, "sideways")


def test_generation_uses_every_direction_and_stays_solvable():
    cls = FAMILIES["store"]
    gen0 = [cls.generate(s, 0) for s in range(12)]
    gen1 = evolve_generation(gen0, 0)
    assert {op for _, op in gen1} == set(DIRECTION_NAMES)
    assert all(solvable(s) and s.generation == 1 for s, _ in gen1)


def test_reference_policy_is_deterministic_and_perfect_without_noise():
    spec = FAMILIES["store"].generate(1, 2)
    assert noisy_oracle_episode(spec, 0.0, random.Random(0))["success"]
    a = [noisy_oracle_episode(spec, 0.5, random.Random(7))["success"] for _ in range(1)]
    b = [noisy_oracle_episode(spec, 0.5, random.Random(7))["success"] for _ in range(1)]
    assert a == b


def test_stage_writes_generations_and_resumes(tmp_path):
    cfg = Config.model_validate({"curriculum": {"evolve": {"generations": 2, "problems": 6, "families": ["store"],
                                                            "reference_samples": 2}}})
    from apprentice.stages import evolve as stage

    paths = Paths(tmp_path, 1)
    res = stage.run(cfg, paths)
    out = tmp_path / "data" / "iter_1" / "evolve"
    assert {p.name for p in out.glob("*.parquet")} == {"gen_0.parquet", "gen_1.parquet", "gen_2.parquet",
                                                       "reference.parquet"}
    assert [g["generation"] for g in res["generations"]] == [0, 1, 2]
    assert all(0 <= g["ci_low"] <= g["pass_rate"] <= g["ci_high"] <= 1 for g in res["generations"])
    mtime = (out / "gen_1.parquet").stat().st_mtime
    assert stage.run(cfg, paths) == json.loads((out.parent / "evolve.json").read_text())
    assert (out / "gen_1.parquet").stat().st_mtime == mtime
