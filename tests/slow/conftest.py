"""The slow suite's one shared project: prefect.yaml's deployment, run by a real worker, against the
shared stores a small team runs (``make serve-team``).

Session fixture ``deployed``: a git + DVC copy of the project in a tmp dir (the quick profile shrunk
to two short iterations, :mod:`projectkit`) whose DVC remote is a local directory, a real
``mlflow server`` over HTTP (sqlite backend, proxied artifact root: also the MLflow UI the browser
tests open), a real ``prefect server start``, ``prefect deploy`` of the ``nightly`` deployment
with ``profile=quick``, a process worker, and two triggers: the second sent while the first runs,
so the deployment's concurrency limit must hold it. The UI, report, deployment and shared-stores
tests all look at that one run: it is the costly part (minutes), paid once.

Marked ``slow``: they run with ``APPRENTICE_RUN_SLOW=1`` (``make test-slow``, and ``.ci/run``'s
``make test``, on one xdist worker as the ``deployed-run`` group: tests/conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from projectkit import copy_project, init_repos  # noqa: E402
from uitools import free_port, start, stop, wait_http

POOL = "apprentice-local"  # prefect.yaml's work pool


def make_project(root: Path, env: dict[str, str], remote: Path) -> None:
    """The quick profile shrunk to two short iterations (:mod:`projectkit`): iteration 2 registers
    version 2, so the registry shows both aliases and the report a champion trend."""
    copy_project(root)
    init_repos(root, env, dvc_remote=remote)


@pytest.fixture(scope="session")
def deployed(tmp_path_factory):
    """Deploy, start a worker, trigger twice (the second while the first runs); yields what happened."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    root = tmp_path_factory.mktemp("deployed")
    logs = tmp_path_factory.mktemp("logs")
    stores = tmp_path_factory.mktemp("stores")
    port, mlflow_port = free_port(), free_port()
    api, tracking = f"http://127.0.0.1:{port}/api", f"http://127.0.0.1:{mlflow_port}"
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_HOME": str(root / ".prefect-home"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_WORKER_QUERY_SECONDS": "2",
           "PREFECT_WORKER_PREFETCH_SECONDS": "2", "MLFLOW_TRACKING_URI": tracking,
           "PYTHONPATH": str(root), "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "APPRENTICE_QUIET": "1",
           "PWD": str(root)}  # prefect.yaml's `{{ $PWD }}` reads this variable, not the process's cwd
    make_project(root, env, stores / "dvc-remote")
    prefect = [str(bin_dir / "prefect")]
    tracker = start([str(bin_dir / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{stores / 'mlflow.db'}",
                     "--artifacts-destination", str(stores / "artifacts"), "--host", "127.0.0.1",
                     "--port", str(mlflow_port), "--workers", "1"], root,
                    {**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, logs / "mlflow-server.log")
    server = start([*prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)], root, env,
                   logs / "server.log")
    worker = None
    try:
        wait_http(f"{tracking}/health", tracker, logs / "mlflow-server.log")
        wait_http(f"{api}/health", server, logs / "server.log")
        subprocess.run([*prefect, "work-pool", "create", POOL, "--type", "process"], cwd=root, env=env, check=True,
                       capture_output=True)
        dep = subprocess.run([*prefect, "--no-prompt", "deploy", "--name", "nightly", "--param", "profile=quick"],
                             cwd=root, env=env, capture_output=True, text=True)
        assert dep.returncode == 0, dep.stdout[-3000:] + dep.stderr[-3000:]
        worker = start([*prefect, "worker", "start", "--pool", POOL], root, env, logs / "worker.log")
        with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            deployment = client.read_deployment_by_name("self-improve/nightly")
            first = run_deployment("self-improve/nightly", timeout=0)
            t0, states = time.time(), {"first": [], "second": []}
            while client.read_flow_run(first.id).state.type.value != "RUNNING":  # type: ignore[union-attr]
                assert time.time() - t0 < 1200, f"the worker never started the run:\n{(logs / 'worker.log').read_text()[-3000:]}"
                time.sleep(1)
            second = run_deployment("self-improve/nightly", timeout=0)
            overlap = False
            while True:
                a, b = client.read_flow_run(first.id), client.read_flow_run(second.id)
                states["first"].append(a.state.name)  # type: ignore[union-attr]
                states["second"].append(b.state.name)  # type: ignore[union-attr]
                overlap |= a.state.type.value == "RUNNING" and b.state.type.value == "RUNNING"  # type: ignore[union-attr]
                if b.state.is_final():  # type: ignore[union-attr]
                    break
                assert time.time() - t0 < 1800, (states, (logs / "worker.log").read_text()[-4000:])
                time.sleep(2)
            first, second = client.read_flow_run(first.id), client.read_flow_run(second.id)
        yield {"root": root, "wd": root / "runs" / "quick", "env": env, "api": api, "deployment": deployment,
               "first": first, "second": second, "states": states, "overlap": overlap, "logs": logs,
               "store": tracking, "remote": stores / "dvc-remote"}
    finally:
        if worker is not None:
            stop(worker)
        stop(server)
        stop(tracker)
