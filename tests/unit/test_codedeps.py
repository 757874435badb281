"""Stage code deps come from the import graph, and the skip-fingerprints see code changes: a stage
reruns whenever code it runs changes, not only when someone remembers to list the file."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
from dvcstages import expand_file

from apprentice import codedeps, pipeline
from apprentice.ops import dvcgen

REPO = Path(__file__).resolve().parents[2]


def test_import_graph_follows_lazy_relative_and_importlib_imports(tmp_path):
    pkg = tmp_path / "apprentice"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "stage.py": "from apprentice.sub import leaf\n\ndef run():\n    from . import lazy\n",
        "lazy.py": "import importlib\nimportlib.import_module('apprentice.dyn')\n",
        "dyn.py": "from .sub.leaf import X\n",
        "sub/__init__.py": "",
        "sub/leaf.py": "import json\nX = 1\n",
        "unused.py": "",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    got = {p.relative_to(tmp_path).as_posix() for p in codedeps.closure(["apprentice.stage"], tmp_path)}
    assert got == {f"apprentice/{n}" for n in files if n != "unused.py"}


def _covered(path: str, deps: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in deps)


def test_every_dvc_stage_lists_every_project_module_it_imports():
    """The committed dvc.yaml: a stage importing a project module its deps do not list fails here."""
    stages = expand_file(REPO / "dvc.yaml")  # matrix members as DVC runs them
    for name, spec in stages.items():
        cmd = spec["cmd"].split()
        stage = pipeline.get(cmd[3]).module
        files = [p.relative_to(REPO).as_posix() for p in codedeps.closure([stage, "apprentice.__main__"], REPO)]
        files = [f for f in files if f != dvcgen.REGISTRY]  # tracked through what dvc.yaml renders from it
        missing = [f for f in files if not _covered(f, spec["deps"])]
        assert not missing, f"DVC stage {name} imports {missing} but does not list them in its deps"
    # modules easy to miss in a hand-kept deps list, pinned by name
    need = {"sft-1": "apprentice/data/trajectories.py", "evaluate-1@sft": "apprentice/lm/modeling.py",
            "rl-1": "apprentice/policies/hf_cached.py", "distill-1": "apprentice/policies/hf.py",
            "promote-1": "apprentice/gate"}
    for name, f in need.items():
        assert _covered(f, stages[name]["deps"]), (name, f)
    assert _covered("apprentice/rollout/episodes.py", stages["distill-1"]["deps"])


def test_rollout_fingerprint_changes_when_an_environment_changes(tmp_path, monkeypatch):
    from apprentice.config import Config, PolicyConfig
    from apprentice.rollout import shards

    shutil.copytree(REPO / "apprentice", tmp_path / "apprentice", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(codedeps, "REPO", tmp_path)
    problems = pd.DataFrame({"spec": ["{}"]})
    cfg = Config.model_validate({})
    before = shards.fingerprint(problems, PolicyConfig(kind="oracle"), cfg, "apprentice.stages.rollout")
    assert shards.fingerprint(problems, PolicyConfig(kind="oracle"), cfg, "apprentice.stages.rollout") == before
    grid = tmp_path / "apprentice" / "envs" / "grid.py"
    grid.write_text(grid.read_text() + "\n# an edited environment\n")
    assert shards.fingerprint(problems, PolicyConfig(kind="oracle"), cfg, "apprentice.stages.rollout") != before
