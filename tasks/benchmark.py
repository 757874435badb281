"""Prefect task for the ``benchmark`` stage (see :mod:`tasks._dvc`)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks._dvc import StageContext, run_stage


@task(name="benchmark", cache_policy=NO_CACHE, retries=0)
def benchmark(ctx: StageContext) -> dict[str, Any]:
    return run_stage("benchmark", ctx)
