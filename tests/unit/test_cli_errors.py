"""Bad input to the CLI gives one clear error naming the file/key and the fix, not a traceback."""

from __future__ import annotations

import pytest

from apprentice.__main__ import describe, main
from apprentice.config import ConfigError, load_config


def _params(tmp_path, text: str):
    p = tmp_path / "params.yaml"
    p.write_text(text)
    return p


def test_invalid_yaml_names_the_file_and_line(tmp_path, capsys):
    p = _params(tmp_path, "sft:\n  max_steps: 3\n bad: [\n")
    assert main(["synth", "--params", str(p), "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{p}:3:" in err and "invalid YAML" in err
    assert "Traceback" not in err


def test_duplicate_section_fails_at_load(tmp_path):
    p = _params(tmp_path, "sft:\n  max_steps: 3\nrl:\n  max_steps: 1\nsft:\n  max_steps: 9\n")
    with pytest.raises(ConfigError, match=r"params.yaml:5: key 'sft' appears twice .*first on line 1"):
        load_config(p)
    nested = _params(tmp_path, "sft:\n  max_steps: 3\n  max_steps: 4\n")
    with pytest.raises(ConfigError, match="key 'max_steps' appears twice"):
        load_config(nested)


def test_pass_k_larger_than_samples_fails_at_load(tmp_path):
    p = _params(tmp_path, "evaluate:\n  samples_per_problem: 1\n  pass_k: [1, 5]\n")
    with pytest.raises(ConfigError, match=r"pass@5 needs at least 5 samples.*evaluate.samples_per_problem"):
        load_config(p)
    assert load_config(p, overrides=["evaluate.samples_per_problem=5"]).evaluate.pass_k == [1, 5]


def test_unexpected_errors_are_one_line_with_a_fix():
    from safetensors import SafetensorError

    line = describe(SafetensorError("Error while deserializing header: incomplete metadata, file not fully covered"))
    assert "\n" not in line and "truncated" in line and "--debug" in line
    import httpx

    line = describe(httpx.ConnectError("[Errno 111] Connection refused"))
    assert "endpoint is not reachable" in line


def test_stage_error_is_one_line_and_debug_shows_the_traceback(tmp_path, capsys):
    bad = tmp_path / "data" / "iter_1" / "problems.parquet"  # a corrupt input (e.g. a cut copy)
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"PAR1 not really parquet")
    args = ["teacher-rollout", "--profile", "quick", "--root", str(tmp_path)]
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error in stage teacher-rollout: ") and "--debug" in err
    with pytest.raises(Exception):  # noqa: B017 - whatever the reader raises, --debug lets it through
        main([*args, "--debug"])


def test_missing_base_model_under_evaluate_names_the_folder(tmp_path, capsys):
    from apprentice.data.trajectories import problems_frame, write_parquet
    from apprentice.envs import FAMILIES
    from apprentice.paths import Paths

    spec = FAMILIES["grid"].make_spec(seed=0, difficulty={"size": 5, "obstacles": 0, "keys": 0, "budget_slack": 2})
    write_parquet(problems_frame([spec], [0], split="eval"), Paths(tmp_path).eval_problems)
    # a folder no checkout has (a repo that ran `make run` has models/base, resolved against the cwd)
    params = _params(tmp_path, "model:\n  base: models/missing-base\n")
    assert main(["evaluate", "--policy", "base", "--root", str(tmp_path), "--params", str(params)]) == 1
    err = capsys.readouterr().err.strip()
    assert "model folder models/missing-base does not exist" in err and "prepare-base" in err  # not a hub error
