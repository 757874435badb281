"""The typed config fails at load with a message naming the key and how to fix it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from apprentice.config import Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_params_yaml_is_valid_and_matches_schema():
    cfg = load_config(ROOT / "params.yaml")
    assert isinstance(cfg, Config)


def test_every_profile_loads():
    for p in (ROOT / "apprentice" / "profiles").glob("*.yaml"):
        cfg = load_config(ROOT / "params.yaml", profile=p.stem)
        assert cfg.pipeline.profile == p.stem


def test_unknown_key_is_named(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"sft": {"max_stepz": 3}}))
    with pytest.raises(ConfigError, match=r"'sft.max_stepz' is not a known key"):
        load_config(f)


def test_bad_value_names_key_and_fix(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"rl": {"num_generations": 1}}))
    with pytest.raises(ConfigError, match=r"'rl.num_generations'.*--set rl.num_generations="):
        load_config(f)


def test_unknown_family_lists_known_ones():
    with pytest.raises(ConfigError, match="unknown environment families"):
        load_config(ROOT / "params.yaml", overrides=["synth.families=[nope]"])


def test_override_wins_and_is_typed():
    cfg = load_config(ROOT / "params.yaml", overrides=["sft.max_steps=7", "rollout.teacher.temperature=0.5"])
    assert cfg.sft.max_steps == 7 and cfg.rollout.teacher.temperature == 0.5


def test_malformed_override_and_unknown_profile():
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(ROOT / "params.yaml", overrides=["sft.max_steps"])
    with pytest.raises(ConfigError, match="unknown profile"):
        load_config(ROOT / "params.yaml", profile="nope")


def test_missing_explicit_params_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "absent.yaml")


def test_micro_batches_must_divide_the_step():
    """Micro-batches must split the step's batch evenly; the error names the key and a fix."""
    with pytest.raises(ConfigError, match=r"distill.micro_batch_size \(3\) must divide distill.batch_size \(8\)"):
        load_config(ROOT / "params.yaml", overrides=["distill.micro_batch_size=3"])
    with pytest.raises(ConfigError, match=r"rl.micro_batch_size \(5\) must divide"):
        load_config(ROOT / "params.yaml", overrides=["rl.micro_batch_size=5"])
    assert load_config(ROOT / "params.yaml", overrides=["distill.micro_batch_size=16"]).distill.micro_batch_size == 16


def test_evaluate_drafts_takes_auto_true_or_false():
    for text, value in (("auto", "auto"), ("true", True), ("false", False)):
        assert load_config(ROOT / "params.yaml", overrides=[f"evaluate.drafts={text}"]).evaluate.drafts == value
    with pytest.raises(ConfigError, match=r"'evaluate.drafts'.*--set evaluate.drafts="):
        load_config(ROOT / "params.yaml", overrides=["evaluate.drafts=sometimes"])


def test_repeat_stop_applies_to_greedy_evaluation_only():
    """A sampled agent can leave a loop of identical steps, so sampled evaluation plays on."""
    assert load_config(ROOT / "params.yaml").evaluate.repeat_stop == 3
    sampled = load_config(ROOT / "params.yaml", overrides=["evaluate.temperature=0.7"])
    assert sampled.evaluate.max_repeats == 3 and sampled.evaluate.repeat_stop == 0
