"""The schedule really runs: prefect.yaml's deployment, served by a real server and process worker,
completes a run of the quick profile; a second trigger while one runs waits for it (concurrency 1)."""

from __future__ import annotations

import yaml
from uitools import REPO, slow_only

pytestmark = slow_only()


def test_deployment_has_the_schedule_and_concurrency_of_prefect_yaml(deployed):
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"][0]
    dep = deployed["deployment"]
    assert dep.name == spec["name"] and dep.work_pool_name == spec["work_pool"]["name"]
    assert dep.parameters == {**spec["parameters"], "profile": "quick"}
    assert [s.schedule.cron for s in dep.schedules] == [spec["schedules"][0]["cron"]]
    assert dep.global_concurrency_limit is not None and dep.global_concurrency_limit.limit == spec["concurrency_limit"]


def test_worker_runs_the_deployment_to_completion(deployed):
    first = deployed["first"]
    assert first.state.is_completed(), (first.state, (deployed["logs"] / "worker.log").read_text()[-4000:])
    wd = deployed["wd"]
    for k in (1, 2):
        assert (wd / f"reports/iter_{k}/promotion.json").exists() and (wd / f"reports/iter_{k}/index.html").exists()


def test_second_trigger_waits_for_the_running_one(deployed):
    first, second = deployed["first"], deployed["second"]
    assert not deployed["overlap"], deployed["states"]
    assert "AwaitingConcurrencySlot" in deployed["states"]["second"], deployed["states"]
    assert second.state.is_completed(), second.state
    assert second.start_time >= first.end_time  # it ran only after the first had finished


def test_prefect_ui_shows_the_completed_run(deployed):
    """Where `make serve` sends people: the flow run page, with one task run per stage."""
    from uitools import chromium, screenshot, wait_for_all

    ui = deployed["api"].removesuffix("/api")
    with chromium() as d:
        d.get(f"{ui}/runs/flow-run/{deployed['first'].id}")
        wait_for_all(d, ["Completed", deployed["first"].name, "self-improve"], "the completed flow run")
        screenshot(d, "prefect_flow_run")
