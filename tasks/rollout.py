"""Prefect task for the ``teacher-rollout`` stage (see :mod:`tasks._dvc`).

Retried: episodes against a remote teacher endpoint fail transiently (timeouts, 5xx); the stage
resumes from the shards it flushed (``apprentice.shards``), so a retry runs only the unfinished episodes."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks._dvc import ROLLOUT_RETRIES, StageContext, run_stage


@task(name="teacher-rollout", cache_policy=NO_CACHE, retries=ROLLOUT_RETRIES, retry_delay_seconds=10)
def rollout(ctx: StageContext) -> dict[str, Any]:
    return run_stage("teacher-rollout", ctx)
