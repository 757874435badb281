"""Prefect task for the ``evaluate`` stage (see :mod:`tasks._dvc`).

Retried: episodes against a remote teacher endpoint fail transiently (timeouts, 5xx); the stage
resumes from its own fingerprinted output, so a retry costs only what was not written."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks._dvc import ROLLOUT_RETRIES, StageContext, run_stage


@task(name="evaluate", cache_policy=NO_CACHE, retries=ROLLOUT_RETRIES, retry_delay_seconds=10)
def evaluate(ctx: StageContext) -> dict[str, Any]:
    return run_stage("evaluate", ctx)
