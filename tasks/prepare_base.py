"""Prefect task for the ``prepare-base`` stage (see :mod:`tasks._dvc`)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks._dvc import StageContext, run_stage


@task(name="prepare-base", cache_policy=NO_CACHE, retries=0)
def prepare_base(ctx: StageContext) -> dict[str, Any]:
    return run_stage("prepare-base", ctx)
