"""Shared stores (slow): the quick profile against an MLflow tracking server over HTTP (sqlite backend,
proxied artifact root) and a DVC directory remote; then a second clone, as a second machine would:
``dvc pull``, ``dvc repro`` recomputes nothing (``dvc status`` clean) and the registry aliases the
first machine set are readable there, pointing at the weights the clone pulled."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from projectkit import copy_project, init_repos  # the same tiny project as the pipeline test

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd, cwd, env):
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert r.returncode == 0, f"{cmd} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def tracking_server(tmp_path_factory):
    """A real ``mlflow server`` over HTTP: sqlite backend + proxied artifact root, one worker."""
    d = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    mlflow_bin = str(Path(sys.executable).parent / "mlflow")
    proc = subprocess.Popen([mlflow_bin, "server", "--backend-store-uri", f"sqlite:///{d / 'mlflow.db'}",
                             "--artifacts-destination", str(d / "artifacts"), "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1"], env=env,
                            stdout=(d / "server.log").open("w"), stderr=subprocess.STDOUT)  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            break
        except OSError:
            assert proc.poll() is None, (d / "server.log").read_text()[-2000:]
            time.sleep(1)
    else:
        proc.kill()
        pytest.fail("mlflow server did not start in 240 s")
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def test_remote_stores_second_clone_pulls_reproduces_nothing_and_reads_aliases(tmp_path, prefect_api,
                                                                              tracking_server, monkeypatch):
    root, remote, clone = tmp_path / "machine1", tmp_path / "dvc-remote", tmp_path / "machine2"
    root.mkdir()
    copy_project(root)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_server)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "DVC_NO_ANALYTICS": "1", "MLFLOW_TRACKING_URI": tracking_server}
    dvc = [sys.executable, "-m", "dvc"]
    init_repos(root, env, dvc_remote=remote)

    # machine 1: the quick profile through Prefect -> DVC -> MLflow (HTTP), then share code + data
    from flows.self_improve import self_improve

    summary = self_improve(profile="quick", repo=str(root))
    assert summary["tracking_uri"] == tracking_server
    _run(["git", "add", "-A"], root, env)
    _run(["git", "commit", "-qm", "iteration 1"], root, env)
    _run([*dvc, "push"], root / "runs" / "quick", env)
    assert any(remote.rglob("*")), "dvc push wrote nothing to the remote"

    # machine 2: a fresh clone pulls the data and reproduces nothing
    _run(["git", "clone", "-q", str(root), str(clone)], tmp_path, env)
    wd2 = clone / "runs" / "quick"
    _run([*dvc, "pull"], wd2, env)
    status = _run([*dvc, "status"], wd2, {**env, "PYTHONPATH": str(clone)})
    assert "changed" not in status and "modified" not in status, status
    out = _run([*dvc, "repro"], wd2, {**env, "PYTHONPATH": str(clone)})
    assert "Running stage" not in out, out

    # the registry (on the server) is readable from machine 2 and points at what it pulled
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_server, registry_uri=tracking_server)
    promo = json.loads((wd2 / "reports" / "iter_1" / "promotion.json").read_text())
    name = promo["registered_model"]
    for alias in ("challenger", *(["champion"] if promo.get("promoted") else [])):
        mv = client.get_model_version_by_alias(name, alias)
        assert str(mv.version) == str(promo["version"]) or alias == "champion"
    lock = yaml.safe_load((wd2 / "dvc.lock").read_text())
    md5s = {o.get("md5") for st in lock["stages"].values() for o in st.get("outs", [])}
    mv = client.get_model_version_by_alias(name, "challenger")
    assert mv.tags["dvc_md5"] in md5s, (mv.tags, md5s)  # the registered weights are the ones machine 2 pulled
