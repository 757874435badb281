"""tasks/parallel.py: independent DVC stages run concurrently as Prefect tasks on prefect-ray, then
DVC records them, so a following ``dvc repro`` finds nothing to do (what the flow does with the
per-model evaluations when ``rollout.engine: ray``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # Ray start-up can time out on a loaded machine: slow suite only

SLEEP = 4


def _dvc(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "DVC_NO_ANALYTICS": "1"})


def test_ray_parallel_stages_run_concurrently_and_dvc_repro_is_then_a_no_op(tmp_path, prefect_api, ray_cluster):
    from tasks.parallel import repro_parallel

    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    assert _dvc(["init", "-q"], repo).returncode == 0
    _dvc(["config", "core.analytics", "false"], repo)
    # one DVC matrix stage, as dvcgen writes the per-model evaluation: each member sleeps, then writes
    # its output and its start/end times (the command comes from DVC's own interpolation)
    code = (f"import time,pathlib; t=time.time(); time.sleep({SLEEP}); "
            "pathlib.Path('out_${item.name}.txt').write_text(f'{t} {time.time()}')")
    stages = {"eval": {"matrix": {"name": ["a", "b"]}, "cmd": f'python -c "{code}"', "outs": ["out_${item.name}.txt"]}}
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}))
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    t0 = time.perf_counter()
    res = repro_parallel(["dvc.yaml:eval@a", "dvc.yaml:eval@b"], repo, env, address="local")
    assert sorted(res["executed"]) == ["eval@a", "eval@b"]
    spans = [tuple(map(float, (repo / f"out_{n}.txt").read_text().split())) for n in ("a", "b")]
    assert max(s for s, _ in spans) < min(e for _, e in spans), f"stages did not overlap: {spans}"
    assert time.perf_counter() - t0 > SLEEP
    # DVC recorded both: status clean, and repro reruns nothing
    st = _dvc(["status"], repo)
    assert st.returncode == 0 and "changed" not in st.stdout, st.stdout
    rep = _dvc(["repro"], repo)
    assert rep.returncode == 0 and "Running stage" not in rep.stdout, rep.stdout
    assert repro_parallel(["dvc.yaml:eval@a", "dvc.yaml:eval@b"], repo, env)["executed"] == []
