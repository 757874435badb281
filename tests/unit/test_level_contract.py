"""check-env's level contract names the axis and its values, and the stages that synthesize problems
refuse a family it rejects unless the config lists it explicitly. Real environment classes."""

from __future__ import annotations

import pytest

from apprentice.envs import FAMILIES, register
from apprentice.envs.base import DifficultyAxis
from apprentice.envs.check import level_shape, monotone_problems, require_level_contract
from apprentice.envs.search import SearchEnv


def _family(name: str, axis: DifficultyAxis, table: bool = False) -> type:
    """A search family whose last axis is ``axis`` and whose budget slack rises with the level."""
    attrs = {"family": name, "axes": (*SearchEnv.axes[:3], axis), "__module__": "tests.level_contract"}
    if not table:
        attrs["sample_difficulty"] = classmethod(lambda cls, rng, level=None: {
            "hops": 1, "corpus": 0, "distractors": 0, "budget_slack": min(4, 0 + (level or 0) * 2)})
    cls = type(f"Env_{name}", (SearchEnv,), attrs)
    if not FAMILIES.registered(name):
        register(cls)
    return cls


@pytest.mark.parametrize("doc", ["extra actions (more is easier)", "extra actions"])
def test_refusal_names_the_axis_and_its_values(doc):
    name = f"lc_slack_{len(doc)}"
    cls = _family(name, DifficultyAxis("budget_slack", 0, 4, doc))
    problems = monotone_problems(cls, level_shape(cls))
    assert problems and all("budget_slack" in p for p in problems), problems
    assert any("0" in p and "2" in p and "level 0" in p and "level 1" in p for p in problems), problems
    with pytest.raises(ValueError, match=rf"{name}.*budget_slack"):
        require_level_contract([name])
    require_level_contract([name], allowed=[name])  # the explicit override


@pytest.mark.parametrize("family", ["grid", "search", "store"])
def test_builtin_families_pass(family):
    require_level_contract([family])


def test_synth_refuses_a_rejected_family_unless_overridden(tmp_path):
    from test_gates import _cfg

    from apprentice.paths import Paths
    from apprentice.stages import benchmark

    name = "lc_slack_bench"
    _family(name, DifficultyAxis("budget_slack", 0, 4, "extra actions (more is easier)"))
    cfg = _cfg()
    cfg = cfg.model_copy(update={"benchmark": cfg.benchmark.model_copy(update={"families": [name], "n": 3})})
    with pytest.raises(ValueError, match="budget_slack"):
        benchmark.run(cfg, Paths(tmp_path, 1))
    cfg = cfg.model_copy(update={"validate_": cfg.validate_.model_copy(update={"allow_non_monotone": [name]})})
    assert benchmark.run(cfg, Paths(tmp_path, 1))["problems"] == 3
