"""A newcomer's first run: ``git clone`` of HEAD, shrink ``params.yaml``, ``make run`` at the clone's root.

Every other pipeline test runs a copied project under ``runs/quick``; none ran the default profile at
the root of a real git clone, so a ``.gitignore`` line that made DVC refuse ``dvc.lock`` broke
``make run`` and ``dvc repro`` for every new user while CI stayed green. This test is that
user: it clones the committed HEAD (not the working tree), edits ``params.yaml`` the way the README
says (fewer problems and steps, the tiny base model, two iterations), regenerates ``dvc.yaml`` and
commits both as ``python -m apprentice.ops.dvcgen`` tells one to, then runs ``make run``'s own target
with the already built venv (``VENV=...``, its stamp taken as up to date). Once as shipped
(``dtype: auto``, whatever the machine measures) and once with the *other* dtype forced: bf16 on an
AVX2-only machine (the dtype an AMX machine picks), fp32 on an AMX machine (the one AVX2 picks), so
either kind of CI machine runs both.

It asserts what a newcomer would notice: exit 0; every stage of ``dvc.yaml`` ran; ``dvc status``
clean afterwards; no DVC-tracked output holds the clone's absolute path (the same seed in another
folder must hash the same); no tracked file of the clone modified by the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.executable).parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800),
              pytest.mark.skipif(not os.environ.get("APPRENTICE_RUN_SLOW"),
                                 reason="a whole fresh-clone run per dtype: set APPRENTICE_RUN_SLOW=1 (.ci/run does)")]

#: what a user shrinks for a first try (params.yaml keys); everything else stays as shipped
SHRINK = {
    "model": {"base": "models/tiny"},
    "synth": {"n_train": 12},
    "benchmark": {"n": 8},
    "sft": {"max_steps": 2, "batch_size": 2, "save_steps": 2, "max_length": 384},
    "rl": {"max_steps": 1, "prompts_per_step": 1, "num_generations": 2, "probe_problems": 2, "probe_samples": 2,
           "max_completion_length": 32, "max_tool_calls": 2, "save_steps": 1},
    "distill": {"student": {"warmup_steps": 1}, "max_steps": 1, "batch_size": 2, "max_completion_length": 16,
                "save_steps": 1},
    "evaluate": {"max_new_tokens": 16},
    "curriculum": {"evolve": {"generations": 1, "problems": 8}},
    "pipeline": {"iterations": 2},
}


def _merge(base: dict, over: dict) -> dict:
    for k, v in over.items():
        base[k] = _merge(base.get(k, {}), v) if isinstance(v, dict) else v
    return base


def _git(clone: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=clone, check=True, capture_output=True, text=True).stdout


def _tracked_outputs(clone: Path) -> list[Path]:
    lock = yaml.safe_load((clone / "dvc.lock").read_text())["stages"]
    files: list[Path] = []
    for stage in lock.values():
        for out in stage.get("outs", []):
            p = clone / out["path"]
            files += [f for f in p.rglob("*") if f.is_file()] if p.is_dir() else [p]
    return files


@pytest.mark.parametrize("dtype", ["as-shipped", "other-dtype"])
def test_a_fresh_clone_runs_the_default_profile_at_its_root(tmp_path, dtype):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    params = clone / "params.yaml"
    raw = _merge(yaml.safe_load(params.read_text()), SHRINK)
    if dtype == "other-dtype":
        from apprentice.lm.dtypes import cpu_auto

        raw["model"]["dtype"] = {"bf16": "fp32", "fp32": "bf16"}[cpu_auto().dtype]
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    env = {**os.environ, "GIT_AUTHOR_NAME": "n", "GIT_AUTHOR_EMAIL": "n@n", "GIT_COMMITTER_NAME": "n",
           "GIT_COMMITTER_EMAIL": "n@n", "PREFECT_HOME": str(tmp_path / "prefect-home")}
    for var in ("PYTHONPATH", "PREFECT_API_URL", "MLFLOW_TRACKING_URI", "PROFILE"):  # a newcomer's shell has none
        env.pop(var, None)
    subprocess.run([sys.executable, "-m", "apprentice.ops.dvcgen"], cwd=clone, env=env, check=True, capture_output=True)
    _git(clone, "commit", "-qam", "a smaller first run")

    stamp = VENV / ".installed"
    run = subprocess.run(["make", "run", f"VENV={VENV}", "-o", str(stamp)], cwd=clone, env=env,
                         capture_output=True, text=True, timeout=1700)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-5000:]
    assert "Traceback" not in out, out[-5000:]

    dvc = [str(VENV / "bin" / "python"), "-m", "dvc"]
    stages = subprocess.run([*dvc, "stage", "list", "--name-only"], cwd=clone, env=env, check=True,
                            capture_output=True, text=True).stdout.split()
    assert len(stages) > 20
    assert not [s for s in stages if f"Running stage '{s}'" not in out], out[-3000:]
    status = subprocess.run([*dvc, "status"], cwd=clone, env=env, capture_output=True, text=True)
    assert status.returncode == 0 and "up to date" in status.stdout, status.stdout + status.stderr

    needles = {str(clone).encode(), str(clone.resolve()).encode()}
    leaking = [f.relative_to(clone).as_posix() for f in _tracked_outputs(clone)
               if any(n in f.read_bytes() for n in needles)]
    assert not leaking, f"DVC-tracked outputs hold the clone's absolute path: {leaking}"
    assert _git(clone, "status", "--porcelain", "--untracked-files=no") == ""
    assert "dvc.lock" in _git(clone, "status", "--porcelain")  # the run's record, for the user to commit
