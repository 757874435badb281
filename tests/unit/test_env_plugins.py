"""Environments anyone can add. The example family of docs/environments.md, registered without editing
the package (params key in a subprocess, entry point in-process), passes check-env; the shipped
adapters work in synth.families; every tool schema is what a strict OpenAI-compatible server accepts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from apprentice import envs
from apprentice.config import Config, ConfigError, load_config
from apprentice.envs import FAMILIES, resolve
from apprentice.envs.base import _OPENAI_FUNCTION_KEYS

REPO = Path(__file__).resolve().parents[2]


def _readme_example() -> str:
    text = (REPO / "docs" / "environments.md").read_text()
    section = text.split("## Adding an environment", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def families_snapshot(monkeypatch):
    saved = dict(FAMILIES)
    monkeypatch.setattr(envs, "_loaded_entry_points", set())
    yield
    FAMILIES.clear()
    FAMILIES.update(saved)


def _package(root: Path, pkg: str) -> None:
    (root / pkg).mkdir(parents=True)
    (root / pkg / "__init__.py").write_text("")
    (root / pkg / "counter.py").write_text(_readme_example())


def test_readme_example_via_params_key_passes_check_env_in_a_subprocess(tmp_path):
    _package(tmp_path, "my_envs")
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"envs": {"modules": ["my_envs.counter"]},
                                      "synth": {"families": ["grid", "counter"]}}))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    out = subprocess.run([sys.executable, "-m", "apprentice", "check-env", "counter", "--params", str(params),
                          "--seeds", "2"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=580)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "counter: OK" in out.stdout and '"name": "add"' in out.stdout


def test_readme_example_via_entry_point(tmp_path, monkeypatch, families_snapshot):
    _package(tmp_path, "ep_envs")
    dist = tmp_path / "ep_envs-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-envs\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[apprentice.envs]\ncounter = ep_envs.counter:CounterEnv\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    FAMILIES.pop("counter", None)
    cfg = Config.model_validate({"synth": {"families": ["grid", "counter"]}})  # found through the entry point
    assert cfg.synth.families == ["grid", "counter"] and resolve("counter").__module__ == "ep_envs.counter"
    from apprentice.envs.check import check_family

    assert check_family("counter", levels=[0, 3], seeds=2, echo=lambda *_: None) == []


def test_check_env_finds_a_broken_family(families_snapshot):
    from apprentice.envs.base import Environment, tool
    from apprentice.envs.check import check_family

    class Broken(Environment):  # raises on bad input, returns non-strings, oracle never wins
        family = "broken_test"
        axes = FAMILIES["grid"].axes

        def build(self, spec):
            return "task"

        def oracle(self):
            from apprentice.envs.base import ToolCall

            return [ToolCall("poke", {"x": 1})]

        def turn_budget(self):
            return 3

        @tool
        def poke(self, x: int) -> str:
            """Poke.

            Args:
                x: Where.
            """
            return "poked"

    FAMILIES["broken_test"] = Broken
    with pytest.raises(RuntimeError):  # generate refuses: the oracle never solves it
        Broken.generate(0, 0)
    found = check_family("broken_test", levels=[0], seeds=1, echo=lambda *_: None)
    assert any("generate raised RuntimeError" in f for f in found)


def test_register_refuses_a_family_without_tools_and_names_the_old_protocol(families_snapshot):
    """A family written before tools were marked (plain public tools, underscored protocol) would
    register and then fail every episode with "unknown tool": register refuses it, saying what to rename."""
    from apprentice.envs import register
    from apprentice.envs.base import Environment

    class Legacy(Environment):
        family = "legacy_test"
        axes = FAMILIES["grid"].axes

        def _build(self, spec):
            return "task"

        def _oracle(self):
            return []

        def poke(self, x: int) -> str:
            """Poke.

            Args:
                x: Where.
            """
            return "poked"

    with pytest.raises(TypeError, match=r"no tools: rename _build -> build, _oracle -> oracle; mark each method"):
        register(Legacy)
    assert "legacy_test" not in FAMILIES


def test_adapter_families_are_selectable_in_synth(tmp_path, families_snapshot):
    cfg = Config.model_validate({"synth": {"families": ["grid", "toytext_frozenlake", "rg_basic_arithmetic"],
                                           "n_train": 3, "levels": [0]}, "benchmark": {"n": 3}})
    from apprentice.paths import Paths
    from apprentice.stages import benchmark, synth

    benchmark.run(cfg, Paths(tmp_path, 1))
    summary = synth.run(cfg, Paths(tmp_path, 1))
    assert set(summary["counts"]["train"]) == {"grid", "toytext_frozenlake", "rg_basic_arithmetic"}
    with pytest.raises(ConfigError, match="envs.modules"):
        load_config(_write(tmp_path / "p.yaml", {"synth": {"families": ["no_such_family"]}}))
    with pytest.raises(ConfigError, match="no_such_module"):
        load_config(_write(tmp_path / "q.yaml", {"envs": {"modules": ["no_such_module"]}}))


def _write(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("family", ["grid", "search", "store", "toytext_frozenlake", "toytext_taxi",
                                    "rg_basic_arithmetic"])
def test_tool_schemas_are_strict_openai_functions(family):
    """No non-standard ``return`` key (transformers adds one for a ``Returns:`` docstring section)."""
    for s in resolve(family).tool_schemas():
        assert set(s) == {"type", "function"} and s["type"] == "function"
        assert set(s["function"]) <= set(_OPENAI_FUNCTION_KEYS), s["function"].keys()
        assert s["function"]["parameters"]["type"] == "object"


def test_a_builtin_family_is_its_file_alone(tmp_path):
    """Every public module of apprentice/envs that is not protocol or tooling is a family,
    imported with the package; a new file there is found without editing any list."""
    assert set(envs.builtin_modules()) == {"grid", "search", "shell", "store"}
    import shutil

    shutil.copytree(Path(envs.__file__).parents[1], tmp_path / "apprentice", ignore=shutil.ignore_patterns("__pycache__"))
    pkg = tmp_path / "apprentice" / "envs"
    (pkg / "echo.py").write_text(
        "from apprentice.envs import register, tool\nfrom apprentice.envs.grid import GridEnv\n\n\n"
        "@register\nclass EchoEnv(GridEnv):\n    family = 'echo'\n\n"
        "    @tool\n    def shout(self, text: str) -> str:\n"
        "        \"\"\"Say it loud.\n\n        Args:\n            text: What to say.\n        \"\"\"\n"
        "        return text.upper()\n")
    (pkg / "_helper.py").write_text("raise RuntimeError('private modules are not imported')\n")
    code = ("from apprentice.envs import FAMILIES, builtin_modules; from apprentice.envs.check import surface_problems;"
            "print(sorted(FAMILIES), builtin_modules(), FAMILIES['echo'].tool_names(), surface_problems(FAMILIES['echo']))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)}, check=True).stdout
    assert "'echo'" in out.split("]")[0], out
    assert "['move', 'pick_up', 'shout'] []" in out, out  # its own @tool joins the inherited ones; nothing flagged
