"""Shared stores, as a second machine sees them: the deployed quick run logged to an MLflow tracking
server over HTTP and pushes to a DVC directory remote; a fresh clone ``dvc pull``s, ``dvc status``
is clean and ``dvc repro`` recomputes nothing, and the registry aliases the first machine set are
readable there, pointing at the weights the clone pulled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml
from uitools import slow_only

pytestmark = slow_only()


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> str:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert r.returncode == 0, f"{cmd} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def test_remote_stores_second_clone_pulls_reproduces_nothing_and_reads_aliases(deployed, tmp_path):
    root, env, remote, tracking = deployed["root"], deployed["env"], deployed["remote"], deployed["store"]
    dvc = [sys.executable, "-m", "dvc"]
    # machine 1 (the worker's run): share code + data
    _run(["git", "add", "-A", "runs"], root, env)  # the run's lock file and git-tracked outputs (not .prefect-home)
    _run(["git", "commit", "-qm", "two quick iterations", "--allow-empty"], root, env)
    _run([*dvc, "push"], deployed["wd"], env)
    assert any(remote.rglob("*")), "dvc push wrote nothing to the remote"

    # machine 2: a fresh clone pulls the data and reproduces nothing
    clone = tmp_path / "machine2"
    _run(["git", "clone", "-q", str(root), str(clone)], tmp_path, env)
    wd2 = clone / "runs" / "quick"
    env2 = {**env, "PYTHONPATH": str(clone)}
    _run([*dvc, "pull"], wd2, env2)
    status = _run([*dvc, "status"], wd2, env2)
    assert "changed" not in status and "modified" not in status, status
    out = _run([*dvc, "repro"], wd2, env2)
    assert "Running stage" not in out, out

    # the registry (on the server) is readable from machine 2 and points at what it pulled
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking, registry_uri=tracking)
    promo = json.loads((wd2 / "reports" / "iter_2" / "promotion.json").read_text())
    name = promo["registered_model"]
    challenger = client.get_model_version_by_alias(name, "challenger")
    assert str(challenger.version) == str(promo["version"])
    lock = yaml.safe_load((wd2 / "dvc.lock").read_text())
    md5s = {o.get("md5") for st in lock["stages"].values() for o in st.get("outs", [])}
    assert challenger.tags["dvc_md5"] in md5s, (challenger.tags, md5s)  # the registered weights machine 2 pulled
    if promo.get("promoted") or "champion" in client.get_registered_model(name).aliases:
        champion = client.get_model_version_by_alias(name, "champion")
        assert champion.tags["dvc_md5"] in md5s
