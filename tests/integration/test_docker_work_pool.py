"""prefect.yaml's ``docker-quick`` deployment on a real local Prefect server and a Docker work pool.

Registering it (pool of type ``docker`` from prefect-docker, image, volumes) is checked whenever an
engine answers; a Docker worker running the quick profile to completion in the image needs
``make docker`` first and ``APPRENTICE_RUN_SLOW=1`` (the `.ci/run` Docker suite)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from apprentice.infra import sandbox as sb

OK, WHY = sb.engine_available()
pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.timeout(2700),  # a vfs engine copies the whole image per container, then the flow runs
              pytest.mark.skipif(not OK, reason=f"no Docker engine: {WHY}"),
              pytest.mark.skipif(not os.environ.get("APPRENTICE_RUN_SLOW"), reason="set APPRENTICE_RUN_SLOW=1")]
REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).parent / "prefect")


def _prefect(api: str, *args: str, timeout: int = 300) -> str:
    env = {**os.environ, "PREFECT_API_URL": api, "DOCKER_HOST": sb._host[0]}
    r = subprocess.run([PREFECT, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout


def test_docker_deployment_registers_and_a_docker_worker_runs_the_quick_profile(prefect_api):
    _prefect(prefect_api, "work-pool", "create", "apprentice-docker", "--type", "docker", "--overwrite")
    _prefect(prefect_api, "--no-prompt", "deploy", "--name", "docker-quick")
    out = _prefect(prefect_api, "deployment", "inspect", "self-improve/docker-quick")
    assert "apprentice-docker" in out and "apprentice:latest" in out and "apprentice-dvc-cache:/app/.dvc/cache" in out

    try:
        sb.client().images.get("apprentice:latest")
    except Exception:  # noqa: BLE001
        pytest.skip("image apprentice:latest not built; run `make docker` for the worker half of this test")
    run = _prefect(prefect_api, "deployment", "run", "self-improve/docker-quick")
    # the worker's docker client waits 60 s by default; a vfs engine copies the whole image per container
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "DOCKER_HOST": sb._host[0], "DOCKER_CLIENT_TIMEOUT": "900"}
    worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "apprentice-docker", "--run-once"],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = worker.communicate(timeout=1800)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert worker.returncode == 0, out[-3000:]
    flow_run_id = next(w for w in run.split() if len(w) == 36 and w.count("-") == 4)
    deadline = time.time() + 60
    state = ""
    while time.time() < deadline:
        state = _prefect(prefect_api, "flow-run", "inspect", flow_run_id)
        if "COMPLETED" in state or "FAILED" in state or "CRASHED" in state:
            break
        time.sleep(2)
    assert "COMPLETED" in state, state[-3000:]
