"""A third-party environment package, really installed (``pip install --no-deps --target``
into a temp dir, its ``apprentice.envs`` entry point in the ``.dist-info``), is found wherever a
family name is resolved, and its version and source are part of the fingerprints and the DVC deps."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from apprentice import envs
from apprentice.envs import FAMILIES

REPO = Path(__file__).resolve().parents[2]


def _readme_example() -> str:
    section = (REPO / "docs" / "environments.md").read_text().split("## Adding an environment", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match
    return match.group(1).replace('family = "counter"', 'family = "tally"')


def _install(tmp: Path, version: str) -> Path:
    """Build and install package ``tally_envs`` (the docs/environments.md family, renamed) into ``tmp/site``."""
    src = tmp / f"src-{version}"
    (src / "tally_envs").mkdir(parents=True)
    (src / "tally_envs" / "__init__.py").write_text("")
    (src / "tally_envs" / "counter.py").write_text(_readme_example())
    (src / "pyproject.toml").write_text(textwrap.dedent(f"""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "tally-envs"
        version = "{version}"
        [project.entry-points."apprentice.envs"]
        tally = "tally_envs.counter:CounterEnv"
        [tool.setuptools]
        packages = ["tally_envs"]
    """))
    site = tmp / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                        "--quiet", "--upgrade", "--target", str(site), str(src)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return site


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    saved = dict(FAMILIES)
    monkeypatch.setattr(envs, "_loaded_entry_points", set())
    site = _install(tmp_path, "0.1.0")
    monkeypatch.syspath_prepend(str(site))
    yield site
    FAMILIES.clear()
    FAMILIES.update(saved)
    for m in [m for m in sys.modules if m.startswith("tally_envs")]:
        del sys.modules[m]


def test_a_plugin_family_resolves_everywhere_a_family_name_is_looked_up(plugin):
    from apprentice.config import Config
    from apprentice.envs.evolve import directions_of
    from apprentice.policies.oracle import OraclePolicy
    from apprentice.rollout.episodes import run_episodes
    from apprentice.stages.benchmark import generate_unique

    assert not FAMILIES.registered("tally")  # nothing loaded it yet
    cfg = Config.model_validate({"benchmark": {"families": ["grid", "search", "tally"]}})  # benchmark.families
    assert cfg.benchmark.families[-1] == "tally"
    FAMILIES.pop("tally")
    assert [s.family for s in generate_unique([("tally", 1, 5)], set(), "benchmark")] == ["tally"]  # benchmark
    FAMILIES.pop("tally")
    spec = FAMILIES["tally"].generate(3, 1)  # plain dict access (gates, difficulty, distill use it)
    FAMILIES.pop("tally")
    (traj,) = run_episodes([spec], OraclePolicy(), progress=False)  # the rollout engine's own lookup
    assert traj.success and traj.family == "tally"
    FAMILIES.pop("tally")
    assert "tally" in FAMILIES and directions_of("tally")["harness"] == [("budget_cut", 1)]  # evolution
    from apprentice.training.rl import environment_classes

    assert environment_classes(["tally"])["tally"].__module__ == "tally_envs.counter"  # RL


def test_plugin_version_and_source_are_in_fingerprints_and_dvc_deps(plugin, tmp_path):
    from apprentice.config import Config, PolicyConfig
    from apprentice.data.trajectories import problems_frame
    from apprentice.ops.dvcgen import pipeline
    from apprentice.rollout.shards import fingerprint

    spec = FAMILIES["tally"].generate(1, 0)
    problems = problems_frame([spec], [0], split="train")
    cfg = Config()
    pol = PolicyConfig(kind="openai", model="m", base_url="http://127.0.0.1:1/v1")
    fp = fingerprint(problems, pol, cfg, "apprentice.stages.rollout", samples=1)
    # how answers are fetched is not part of it ...
    moved = pol.model_copy(update={"base_url": "http://10.0.0.1:9/v1", "timeout_s": 5, "max_retries": 9})
    assert fingerprint(problems, moved, cfg, "apprentice.stages.rollout", samples=1) == fp
    # ... but sampling and the plugin's code are
    assert fingerprint(problems, pol.model_copy(update={"temperature": 0.5}), cfg, "apprentice.stages.rollout", samples=1) != fp
    src = envs.source_of("tally")
    assert src["version"] == "tally-envs==0.1.0" and src["metadata"].endswith("METADATA")

    stages = pipeline({"synth": {"families": ["grid", "tally"]}})["stages"]
    for name in ("teacher-rollout-1", "benchmark", "synth-1", "validate-1"):  # every stage that builds envs
        assert src["path"] in stages[name]["deps"] and src["metadata"] in stages[name]["deps"], name
    assert src["path"] not in stages["sft-1"]["deps"]  # a stage that builds no environment: no plugin deps

    module = Path(src["path"]) / "counter.py"
    module.write_text(module.read_text() + "\n# edited\n")
    assert fingerprint(problems, pol, cfg, "apprentice.stages.rollout", samples=1) != fp  # an edited plugin reruns the rollout
    edited = fingerprint(problems, pol, cfg, "apprentice.stages.rollout", samples=1)
    _install(tmp_path, "0.2.0")  # a new version (same source as first installed)
    assert envs.source_of("tally")["version"] == "tally-envs==0.2.0"
    assert fingerprint(problems, pol, cfg, "apprentice.stages.rollout", samples=1) not in (fp, edited)


def test_check_env_fails_a_family_whose_levels_get_easier(monkeypatch):
    """The docs/environments.md family with its axes turned the wrong way (a larger step and more spare turns at a
    higher level, an easy slip when writing one) breaks the level contract, and check-env says so."""
    from apprentice.envs.check import check_family

    saved = dict(FAMILIES)
    src = (_readme_example().replace('family = "tally"', 'family = "tally_easy"')
           .replace('9 - spec.difficulty["step_cut"]', '2 + spec.difficulty["step_cut"]')
           .replace('3 - spec.difficulty["budget_cut"]', 'spec.difficulty["budget_cut"]'))
    try:
        exec(compile(src, "tally_easy.py", "exec"), {"__name__": "tally_easy"})
        failures = check_family("tally_easy", levels=[0, 1, 2], seeds=3, echo=lambda *_: None)
        assert any(f.startswith("level contract (axis") and "level 1 is easier than level 0" in f for f in failures), failures
        exec(compile(_readme_example().replace('"tally"', '"tally_ok"'), "tally_ok.py", "exec"), {"__name__": "tally_ok"})
        assert check_family("tally_ok", levels=[0, 1, 2], seeds=3, echo=lambda *_: None) == []
    finally:
        FAMILIES.clear()
        FAMILIES.update(saved)
