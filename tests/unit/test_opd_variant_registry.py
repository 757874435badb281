"""One registry of distillation variants: every name is selectable and builds exactly one trainer.

``apprentice.training.opd.VARIANTS`` is the only list of ``distill.variant`` names: the config accepts
exactly its names (and names them when it refuses one), and the distill stage's dispatch
(:func:`apprentice.training.distill.make_trainer`) builds the trainer each name's recipe names. There used
to be two registries, one of whose ``vanilla`` could never be selected; these tests keep it one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from apprentice.config import Config, ConfigError, load_config, variant_names
from apprentice.training.opd import VARIANTS
from apprentice.training.opd.variants import recipe_for

REPO = Path(__file__).resolve().parents[2]


def test_the_config_accepts_exactly_the_registered_names():
    assert variant_names() == list(VARIANTS)
    for name in VARIANTS:
        assert load_config(REPO / "params.yaml", overrides=[f"distill.variant={name}"]).distill.variant == name
    with pytest.raises(ConfigError, match="distill.variant") as err:
        load_config(REPO / "params.yaml", overrides=["distill.variant=no_such_variant"])
    assert all(name in str(err.value) for name in VARIANTS)  # the message lists the choices


def test_each_name_names_one_trainer_and_its_own_recipe():
    trainers = {}
    for name in VARIANTS:
        cfg = Config.model_validate({"distill": {"variant": name}})
        recipe = recipe_for(cfg)
        assert recipe.name == name  # no name builds another name's recipe
        trainers[name] = recipe.trainer
    # the default stays TRL's single-turn trainer; every other name runs the multi-turn one
    assert Config().distill.variant == "vanilla"
    assert trainers == {name: "single_turn" if name == "vanilla" else "multi_turn" for name in VARIANTS}


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, smol_tokenizer_dir):
    from apprentice.lm.modeling import load_model, load_tokenizer

    return load_tokenizer(smol_tokenizer_dir), load_model(tiny_model_dir, dtype="fp32"), load_model(tiny_model_dir,
                                                                                                     dtype="fp32")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_registered_name_builds_its_trainer_through_the_distill_dispatch(name, tiny, tmp_path):
    """``distill.variant`` -> the trainer the distill stage trains with (built, not trained)."""
    import pandas as pd

    from apprentice.envs import FAMILIES
    from apprentice.training.distill import (
        ApprenticeDistillationTrainer,
        build_dataset,
        make_trainer,
        problem_prompts,
    )
    from apprentice.training.opd.trainer import OPDTrainer

    tok, student, teacher = tiny
    grid = FAMILIES["grid"]
    spec = grid.make_spec(0, {ax.name: ax.low for ax in grid.axes})
    dataset = build_dataset(problem_prompts(pd.DataFrame([{"family": "grid", "spec": spec.to_json()}])))
    cfg = Config.model_validate({"distill": {"variant": name, "max_steps": 1, "batch_size": 2}})
    trainer = make_trainer(cfg.distill, student=student, teacher=teacher, tokenizer=tok, dataset=dataset,
                           output_dir=tmp_path / "work", dtype="fp32", callbacks=[], apprentice_cfg=cfg)
    if name == "vanilla":
        assert type(trainer) is ApprenticeDistillationTrainer
    else:
        assert isinstance(trainer, OPDTrainer) and trainer.recipe.name == name
