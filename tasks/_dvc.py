"""What every stage task does: run its DVC stage, then record it in MLflow.

Why DVC drives the stage (and not the task calling the Python function directly): DVC decides
whether a stage must run (params, code and data hashes in ``dvc.lock``), so a restarted flow skips
finished stages and ``dvc repro`` alone reproduces everything without Prefect or MLflow. The stage
runs as a subprocess (``dvc repro --single-item``), which isolates DVC's locks and logging and lets
the flow hand the nested MLflow run to the stage through ``MLFLOW_RUN_ID``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from apprentice import pipeline as registry
from apprentice.ops import dvcgen, lineage
from apprentice.paths import Paths
from tasks.failures import StageFailed, StageNotRetryable, stage_failed

__all__ = ["StageContext", "StageFailed", "StageNotRetryable", "run_stage", "stage_env", "stage_failed"]

#: Retries of the stages that talk to a teacher/policy (declared per stage in the registry).
ROLLOUT_RETRIES = registry.ROLLOUT_RETRIES


@dataclass(frozen=True)
class StageContext:
    repo: str  # the git/DVC repository (code lives here)
    workdir: str  # the profile's pipeline dir (repo root for `default`)
    profile: str
    iteration: int | None
    parent_run_id: str | None


def stage_env(repo: Path, run_id: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(repo), env.get("PYTHONPATH", "")] if p)
    env.update(DVC_NO_ANALYTICS="1", DO_NOT_TRACK="true", MLFLOW_DISABLE_TELEMETRY="true")
    env.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory's "experimental" notice, every RL run
    if run_id:
        env["MLFLOW_RUN_ID"] = run_id
    return env


#: what ``dvc repro`` prints after each stage that tells nothing about the run itself
_DVC_HINTS = re.compile(r"^(\s*$|Updating lock file|To track the changes with git|\s+git add |To enable auto staging|"
                        r"\s+dvc config core\.autostage|Use `dvc push` to send)")


def dvc_repro(targets: list[str], workdir: Path, env: dict[str, str],
              log: Path | None = None) -> tuple[int, str, bool]:
    """``dvc repro --single-item *targets``, streaming its output (and into ``log``, whole);
    returns (rc, tail, executed)."""
    proc = subprocess.Popen([sys.executable, "-m", "dvc", "repro", "--single-item", *targets], cwd=workdir,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    tail: deque[str] = deque(maxlen=400)
    executed = False
    assert proc.stdout is not None
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
    with open(log or os.devnull, "w") as out:
        for line in proc.stdout:
            executed |= line.startswith("Running stage")
            tail.append(line)
            out.write(line)
            if _DVC_HINTS.match(line):
                continue  # DVC's git hints after every stage: noise on a normal run (kept in the log)
            sys.stdout.write(line)  # straight to the console: stage progress bars are not log records
            sys.stdout.flush()
    return proc.wait(), "".join(tail), executed


def _failure(name: str, rc: int, tail: str, targets: list[str], wd: Path, log: Path) -> StageFailed:
    where = {"log": os.path.relpath(log, Path.cwd()) if log.is_relative_to(Path.cwd()) else str(log),
             "workdir": "" if wd.resolve() == Path.cwd().resolve() else str(wd),
             "rerun": "dvc repro --single-item " + " ".join(targets)}
    return stage_failed(name, rc, tail, **where)


def _flat_numbers(path: Path, prefix: str) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    # MLflow metric names allow only alphanumerics, _ - . space : / (a gate's table names carry parentheses)
    return {re.sub(r"[^A-Za-z0-9_\-. :/]", "_", f"{prefix}{k}"): v for k, v in lineage.flatten(data).items()
            if isinstance(v, int | float) and not isinstance(v, bool)}


def _flat_strings(path: Path, prefixes: tuple[str, ...]) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return {k: str(v) for k, v in lineage.flatten(data).items() if k.startswith(prefixes) and isinstance(v, str | int)}


def run_stage(stage: str, ctx: StageContext) -> dict[str, Any]:
    """Run one stage of iteration ``ctx.iteration`` through DVC inside a nested MLflow run.

    What it logs comes from the stage's registry entry (:mod:`apprentice.pipeline`): the numbers of
    its result files as metrics (a per-model stage's prefixed by the model), their string keys under
    its tag prefixes as tags, its artifacts, and a training stage's per-step curve."""
    repo, wd, k = Path(ctx.repo), Path(ctx.workdir), ctx.iteration
    spec = registry.get(stage)
    name = dvcgen.stage_name(stage, k)
    targets = [f"dvc.yaml:{s}" for s in dvcgen.dvc_stages(stage, k)]  # evaluate: one DVC stage per model
    raw = yaml.safe_load((wd / "params.yaml").read_text()) or {}
    named = (*spec.params, *(spec.later_params if (k or 0) > 1 else ()))
    params = {key: raw.get(key.split(".")[0]) for key in named if "." not in key}
    at = Paths(wd, k or 1)  # a once-stage (no iteration) writes nothing under iter_k
    t0 = time.monotonic()
    if ctx.parent_run_id is None:  # no lineage (e.g. prepare-base outside an iteration)
        rc, tail, executed = dvc_repro(targets, wd, stage_env(repo, None), at.stage_log(name))
        if rc:
            raise _failure(name, rc, tail, targets, wd, at.stage_log(name))
        return {"stage": name, "executed": executed, "wall_s": round(time.monotonic() - t0, 1)}
    with lineage.stage_run(ctx.parent_run_id, name, k or 0, ctx.profile) as run_id:
        rc, tail, executed = dvc_repro(targets, wd, stage_env(repo, run_id), at.stage_log(name))
        lineage.log_artifacts(run_id, spec.artifacts(at))
        if rc:
            lineage.set_tags(run_id, {"dvc.executed": str(executed), "error": tail[-4000:]})
            raise _failure(name, rc, tail, targets, wd, at.stage_log(name))
        result: dict[str, Any] = {}
        for f in spec.results(at):
            result.update(_flat_numbers(f, f"{f.stem}." if spec.models else ""))
            if spec.tags:
                lineage.set_tags(run_id, _flat_strings(f, spec.tags))
        step_files = [registry.curve_dir(at, spec)] if spec.curve else []  # DVCLive: the files DVC plots
        step_files += [f.parent.parent / ".timings" / f"{f.parent.name}.jsonl" for f in step_files]  # wall clock
        logged = lineage.log_stage(run_id, dvcgen.dvc_stages(stage, k), wd, executed, params, step_files, result)
    return {"stage": name, "executed": executed, "run_id": run_id, "wall_s": round(time.monotonic() - t0, 1), **logged,
            "result": result}
