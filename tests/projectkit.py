"""A throwaway copy of the project for tests that run the real pipeline (Prefect -> DVC -> MLflow).

Shared by the e2e pipeline test, the remote-stores test and the slow UI suite: the same files, the
same shrunken quick profile and the same git + DVC initialisation, written once.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
#: What a run needs from the checkout (no data, models or run outputs).
COPY = ["apprentice", "tasks", "flows", "expectations", "params.yaml", "prefect.yaml", ".dvcignore",
        ".gitignore"]  # the real ignore rules: DVC refuses a git-ignored runs/<profile>/dvc.yaml
#: Sizes where the quick profile leaves a key unset (quick's own values win): the tiny random Llama,
#: a handful of steps and two iterations, so the whole stack runs in minutes.
FAST = {"pipeline": {"iterations": 2}, "model": {"base": "models/tiny"},
        "synth": {"n_train": 12, "levels": [0]}, "benchmark": {"n": 8},
        "sft": {"max_steps": 2, "batch_size": 4, "save_steps": 1},
        "rl": {"max_steps": 1, "prompts_per_step": 1, "num_generations": 2, "max_completion_length": 32,
               "probe_samples": 0, "save_steps": 1},
        "distill": {"max_steps": 1, "batch_size": 2, "max_completion_length": 16, "save_steps": 1,
                    "student": {"warmup_steps": 1}},
        "evaluate": {"max_new_tokens": 24, "batch_size": 8}}


def fill(profile: dict, defaults: dict) -> dict:
    """``defaults`` merged under ``profile`` (the profile's own values win), recursively."""
    for k, v in defaults.items():
        if isinstance(v, dict):
            fill(profile.setdefault(k, {}), v)
        else:
            profile.setdefault(k, v)
    return profile


def copy_project(root: Path) -> None:
    """The project's code and configs under ``root``, with the quick profile shrunk to :data:`FAST`."""
    for name in COPY:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, root / name)
    quick = root / "apprentice/profiles/quick.yaml"
    quick.write_text(yaml.safe_dump(fill(yaml.safe_load(quick.read_text()) or {}, FAST), sort_keys=False))


def init_repos(root: Path, env: dict[str, str], *, dvc_remote: Path | None = None) -> None:
    """``git init`` + ``dvc init`` (analytics off, optionally a default remote), then one commit."""
    dvc = [sys.executable, "-m", "dvc"]
    cmds = [["git", "init", "-q"], [*dvc, "init", "-q"], [*dvc, "config", "core.analytics", "false"]]
    if dvc_remote is not None:
        cmds.append([*dvc, "remote", "add", "-d", "team", str(dvc_remote)])  # committed: every clone knows it
    cmds += [["git", "add", "-A"], ["git", "commit", "-qm", "init"]]
    for cmd in cmds:
        subprocess.run(cmd, cwd=root, env=env, check=True, capture_output=True, text=True)
