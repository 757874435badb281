"""Independent DVC stages in parallel as Prefect tasks on Ray (prefect-ray), e.g. the four per-model
evaluations of an iteration.

Why not ``dvc repro`` in parallel: DVC holds one lock per repository for a whole ``repro``, so a
second one in the same checkout fails at once ("is busy"). So the flow asks DVC what is stale
(``dvc status``), runs those stages' own commands (from ``dvc.yaml``) concurrently, and then lets DVC
record the outputs in ``dvc.lock`` (``dvc commit``), one lock at a time: the result is the lock file
a sequential ``dvc repro`` writes, and a later ``dvc repro`` finds nothing to do.

Why prefect-ray rather than prefect-dask: rollouts already run on Ray (``rollout.engine: ray``), so
one cluster (one ``ray start``, one dashboard, one resource model with GPUs per task) serves both
the stage-level parallelism and the episode-level sharding; Dask would be a second scheduler to run
next to it. ``ray.address`` picks the cluster; ``local`` starts a private one for the flow.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE


def stale_stages(targets: list[str], workdir: Path, env: dict[str, str]) -> list[str]:
    """The DVC stages among ``targets`` whose deps, params or outs changed (``dvc status``)."""
    r = subprocess.run([sys.executable, "-m", "dvc", "status", "--json", *targets], cwd=workdir, env=env,
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"dvc status {' '.join(targets)} failed in {workdir}:\n{r.stderr[-2000:]}")
    status = json.loads(r.stdout or "{}")
    return [t for t in targets if t.split(":")[-1] in status]


@task(name="dvc-stage-cmd", cache_policy=NO_CACHE)
def run_stage_cmd(stage: str, workdir: str, env: dict[str, str]) -> dict[str, Any]:
    """Run one stage's ``cmd`` from ``dvc.yaml`` (no DVC lock taken); returns its wall time.

    DVC itself resolves the stage, so a ``matrix``/``foreach`` member (``evaluate-1@rl``) gets its
    interpolated command."""
    from dvc.repo import Repo

    with Repo(workdir) as repo:
        cmd = repo.stage.load_one(str(Path(workdir) / "dvc.yaml"), stage).cmd  # DVC reads paths from the cwd
    cmds = cmd if isinstance(cmd, list) else [cmd]
    t0 = time.perf_counter()
    for cmd in cmds:
        argv = shlex.split(cmd)
        if argv and argv[0] == "python":  # the same interpreter as the flow, on any worker
            argv[0] = sys.executable
        r = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"stage {stage} failed (exit {r.returncode}): {cmd}\n{(r.stdout + r.stderr)[-3000:]}")
    return {"stage": stage, "wall_s": time.perf_counter() - t0}


def task_runner(address: str = "local") -> Any:
    """prefect-ray's RayTaskRunner on ``address`` (``local``: a private Ray instance for the flow)."""
    try:
        from prefect_ray import RayTaskRunner
    except ImportError:
        raise RuntimeError("parallel stages need prefect-ray: pip install -e '.[ray]' (make setup installs it)") from None
    return RayTaskRunner(address=None if address in ("", "local") else address,
                         init_kwargs={"include_dashboard": False, "log_to_driver": False})


@flow(name="parallel-dvc-stages")
def _parallel(stages: list[str], workdir: str, env: dict[str, str]) -> list[dict[str, Any]]:
    futures = [run_stage_cmd.submit(s, workdir, env) for s in stages]
    return [f.result() for f in futures]


def repro_parallel(targets: list[str], workdir: Path, env: dict[str, str], address: str = "local") -> dict[str, Any]:
    """``dvc repro`` of independent ``targets`` with their commands run concurrently on Ray.

    Returns ``{"executed": [...stale stages run...], "wall_s": {...}}``; a stage that fails raises and
    nothing is committed, so DVC still sees every stage of the batch as stale."""
    stale = stale_stages(targets, workdir, env)
    if not stale:
        return {"executed": [], "wall_s": {}}
    names = [t.split(":")[-1] for t in stale]
    results = _parallel.with_options(task_runner=task_runner(address))(names, str(workdir), env)
    r = subprocess.run([sys.executable, "-m", "dvc", "commit", "--force", *stale], cwd=workdir, env=env,
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"dvc commit {' '.join(stale)} failed:\n{r.stderr[-2000:]}")
    return {"executed": names, "wall_s": {x["stage"]: x["wall_s"] for x in results}}
