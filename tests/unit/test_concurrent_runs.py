"""Two runs at once: the flow lock, stale-run cleanup that spares live runs, a fresh store opened by
several processes together. Real processes, a real MLflow sqlite store."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from apprentice.ops import runlock

REPO = Path(__file__).resolve().parents[2]


def _holder(workdir: Path) -> subprocess.Popen:
    code = ("import sys, time; from apprentice.ops import runlock\n"
            f"with runlock.hold({str(workdir)!r}, 'quick'):\n    print('held', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_second_run_of_a_profile_exits_at_once_naming_the_first(tmp_path):
    holder = _holder(tmp_path)
    try:
        t0 = time.monotonic()
        pattern = rf"another run of profile quick is in progress \(pid {holder.pid} .*started at \d{{4}}-"
        with pytest.raises(runlock.RunInProgress, match=pattern), runlock.hold(tmp_path, "quick"):
            pass
        assert time.monotonic() - t0 < 2  # no waiting
    finally:
        holder.kill()
        holder.wait()
    with runlock.hold(tmp_path, "quick") as me:  # kill -9 released it: no stale lock to delete by hand
        assert me["pid"] > 0


def test_flow_cli_refuses_a_second_run_before_starting_prefect(tmp_path, monkeypatch):
    import flows.self_improve as flow

    monkeypatch.setattr(flow, "REPO", tmp_path)
    holder = _holder(tmp_path / "runs" / "quick")
    try:
        assert flow.main(["--profile", "quick"]) == 3
    finally:
        holder.kill()
        holder.wait()


def test_stale_cleanup_closes_only_runs_whose_process_is_gone(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from apprentice.ops import lineage

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    lineage.configure("sqlite:///mlflow.db", "exp", tmp_path)
    client = MlflowClient()
    exp = client.get_experiment_by_name("exp").experiment_id
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    try:
        runs = {}
        for who, pid in (("live", alive.pid), ("dead", int(dead.stdout))):
            tags = {lineage.TAG_ITER: "1", lineage.TAG_PROFILE: "quick", lineage.TAG_PID: str(pid),
                    lineage.TAG_HOST: __import__("socket").gethostname()}
            runs[who] = client.create_run(exp, run_name=f"iter-1-{who}", tags=tags).info.run_id
            child = client.create_run(exp, run_name="sft", tags={**tags, "mlflow.parentRunId": runs[who]})
            client.set_terminated(child.info.run_id, "FINISHED")
        assert lineage.close_stale_runs(1, "quick") == 1
        live, gone = client.get_run(runs["live"]), client.get_run(runs["dead"])
        assert live.info.status == "RUNNING"  # the live flow's run is not touched
        assert gone.info.status == "KILLED" and "ended without closing" in gone.data.tags[lineage.TAG_KILLED]
        last_child = max(c.info.end_time for c in client.search_runs(
            [exp], f"tags.`mlflow.parentRunId` = '{runs['dead']}'"))
        assert gone.info.end_time == last_child  # the last sign of life, not the cleanup's clock
    finally:
        alive.kill()
        alive.wait()


def test_fresh_store_opened_by_several_processes_at_once(tmp_path):
    code = ("import sys; from apprentice.ops import lineage; "
            "lineage.configure(sys.argv[1], 'exp', sys.argv[2]); print('ok')")
    env_uri = f"sqlite:///{tmp_path / 'fresh.db'}"
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID")}
    procs = [subprocess.Popen([sys.executable, "-c", code, env_uri, str(tmp_path)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(err[-1500:] for _, err in outs)
