"""Seeded runs are reproducible at the DVC level: in a fresh clone of the deployed quick run (another
folder), forcing the benchmark and iteration 1's data, training and distillation stages to run again writes
the same bytes, so ``dvc.lock`` records the
same hashes and ``dvc status`` stays clean. (The iteration report is left out on purpose: it names
the MLflow runs and the git commit of the run it describes.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml
from uitools import slow_only

pytestmark = slow_only()

#: Seeded stages from problem synthesis to an evaluated SFT model: every kind of output (Parquet, gate
#: records, weights, training metrics, evaluation tables).
FORCED = ["benchmark", "synth-1", "teacher-rollout-1", "validate-1", "sft-1", "evaluate-1@sft",  # a matrix member
          "distill-1", "evaluate-1@student"]  # the student's folder must not name its teacher's absolute path


def _outs(lock: Path) -> dict[str, str]:
    stages = yaml.safe_load(lock.read_text())["stages"]
    return {f"{s}:{o['path']}": o.get("md5", "") for s in FORCED for o in stages[s].get("outs", [])}


def test_forced_rerun_of_seeded_stages_gives_identical_dvc_lock_hashes(deployed, tmp_path):
    env = deployed["env"]
    clone = tmp_path / "rerun"
    dvc = [sys.executable, "-m", "dvc"]
    for cmd, cwd in ((["git", "add", "-A", "runs"], deployed["root"]),
                     (["git", "commit", "-qm", "run", "--allow-empty"], deployed["root"]),
                     ([*dvc, "push"], deployed["wd"]),
                     (["git", "clone", "-q", str(deployed["root"]), str(clone)], tmp_path)):
        subprocess.run(cmd, cwd=cwd, env=env, check=True, capture_output=True)
    wd = clone / "runs" / "quick"
    subprocess.run([*dvc, "pull"], cwd=wd, env=env, check=True, capture_output=True)
    before = _outs(wd / "dvc.lock")
    env2 = {**env, "PYTHONPATH": str(clone)}
    r = subprocess.run([*dvc, "repro", "--force", "--single-item",
                        *(f"dvc.yaml:{s}" for s in FORCED)], cwd=wd, env=env2, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert all(f"Running stage '{s}'" in r.stdout for s in FORCED), r.stdout[-3000:]
    after = _outs(wd / "dvc.lock")
    changed = {k: (before[k], after.get(k)) for k in before if before[k] != after.get(k)}
    assert not changed, f"a seeded rerun changed these outputs: {changed}"
