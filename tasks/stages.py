"""One Prefect task per registered stage, made by one factory (no module per stage).

Every stage task does the same thing (:func:`tasks._dvc.run_stage`: its DVC stage inside a nested
MLflow run); what differs between stages (name, retries) is declared in the stage registry
(:mod:`apprentice.pipeline`), so a new stage gets its task without a new file here. Stages that talk
to a teacher/policy endpoint are retried after 10 s: they resume from their own fingerprinted
output, so a retry costs only what was not written. A failure a retry cannot fix (a rejected API key,
nothing listening: :class:`tasks._dvc.StageNotRetryable`) is not retried (:func:`retryable`).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from prefect import Task, task
from prefect.cache_policies import NO_CACHE

from apprentice import pipeline
from tasks._dvc import StageContext, run_stage


def stage_task(name: str) -> Task[..., dict[str, Any]]:
    """The Prefect task that runs pipeline stage ``name`` (a CLI verb or stage name)."""
    return _task(pipeline.get(name))


@cache
def _task(stage: pipeline.Stage) -> Task[..., dict[str, Any]]:
    def run(ctx: StageContext) -> dict[str, Any]:
        return run_stage(stage.name, ctx)

    run.__name__ = run.__qualname__ = stage.name.replace("-", "_")
    run.__doc__ = f"Run the ``{stage.name}`` stage ({stage.module}) through DVC, with lineage in MLflow."
    return task(run, name=stage.name, cache_policy=NO_CACHE, retries=stage.retries,
                retry_delay_seconds=10 if stage.retries else 0, retry_condition_fn=retryable)


def retryable(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's ``retry_condition_fn``: retry unless the failure says a retry cannot help
    (``retryable = False`` on the exception, e.g. :class:`tasks._dvc.StageNotRetryable`)."""
    try:
        state.result()
    except Exception as e:  # noqa: BLE001 - the failed state's own exception
        return getattr(e, "retryable", True) is not False
    return True
