"""What MLflow's own UI shows for a deployed run (two quick iterations), checked in headless
Chromium on the UI of the ``mlflow server`` that run logged to over HTTP: parent runs with nested stage runs, datasets
logged as inputs, the registered model with versions and the champion/challenger aliases, and a
version's link back to the run that registered it. Screenshots: ``$APPRENTICE_SCREENSHOTS``
(``docs/figures/mlflow_*.png`` in docs/operations.md come from here)."""

from __future__ import annotations

import pytest
from uitools import chromium, screenshot, slow_only, wait_for, wait_for_all

pytestmark = slow_only()

MODEL = "apprentice-agent"


@pytest.fixture(scope="module")
def mlflow_ui(deployed):
    """The tracking server the deployed run logged to over HTTP serves the UI itself."""
    return deployed["store"]


@pytest.fixture(scope="module")
def store(deployed):
    from mlflow import MlflowClient

    c = MlflowClient(tracking_uri=deployed["store"], registry_uri=deployed["store"])
    exp = c.get_experiment_by_name("apprentice")
    runs = c.search_runs([exp.experiment_id], max_results=500)
    return {"client": c, "exp": exp.experiment_id, "runs": runs}


def _close_assistant(d) -> None:
    for b in d.find_elements("css selector", "button[aria-label=Close]"):
        if b.is_displayed():
            b.click()


def test_runs_page_shows_iterations_with_nested_stage_runs(mlflow_ui, store):
    with chromium() as d:
        d.get(f"{mlflow_ui}/#/experiments/{store['exp']}/runs?workflowType=machine_learning")
        wait_for(d, lambda t: "iter-1" in t and "iter-2" in t, "the iteration runs")
        _close_assistant(d)
        for b in d.find_elements("css selector", ".ag-row [col-id*='Run Name'] button"):  # expand each parent
            b.click()
        stages = ("prepare-base", "synth-1", "validate-1", "sft-1", "rl-1", "distill-1", "evaluate-1",
                  "promote-1", "report-1", "sft-2", "report-2", "promote-2")
        # the Dataset column: inputs logged per run
        wait_for_all(d, [*stages, "data/iter_1/sft.parquet"], "the nested stage runs and their datasets")
        screenshot(d, "mlflow_runs")


def test_stage_run_page_shows_parent_and_datasets(mlflow_ui, store):
    sft = next(r for r in store["runs"] if r.info.run_name == "sft-1" and r.data.tags.get("dvc.executed") == "True")
    with chromium() as d:
        d.get(f"{mlflow_ui}/#/experiments/{store['exp']}/runs/{sft.info.run_id}")
        md5 = sft.data.tags["dvc.md5.input:data/iter_1/train.parquet"]  # loop-data's set: what SFT trains on
        # the parent's name, the dataset with its digest (the DVC md5) and the params arrive in
        # separate requests: wait for every one
        wait_for_all(d, ["Parent run", "iter-1", "Datasets", "data/iter_1/train.parquet", md5[:32], "sft.max_steps"],
                     "the run overview with its parent, dataset digest and params")
        _close_assistant(d)
        screenshot(d, "mlflow_stage_run")


def test_registry_shows_versions_and_aliases_and_links_back_to_the_run(mlflow_ui, store, deployed):
    """The aliases are what the promotion records say: ``challenger`` is the last candidate;
    ``champion`` exists only once a candidate beat its incumbent (the tiny random model of this run
    never beats the base model; tests/unit/test_promotion.py moves it on a real server)."""
    import json

    c = store["client"]
    aliases = c.get_registered_model(MODEL).aliases
    records = [json.loads((deployed["wd"] / f"reports/iter_{k}/promotion.json").read_text()) for k in (1, 2)]
    assert aliases["challenger"] == str(records[-1]["version"])
    assert ("champion" in aliases) == any(r["promoted"] for r in records), (aliases, records)
    with chromium() as d:
        d.get(f"{mlflow_ui}/#/models/{MODEL}")
        text = wait_for(d, lambda t: "Version 2" in t and all(a in t for a in aliases),
                        f"both versions and the aliases {sorted(aliases)}")
        _close_assistant(d)
        assert "Version 1" in text
        screenshot(d, "mlflow_registry")
        v = str(aliases["challenger"])
        mv = c.get_model_version(MODEL, v)
        d.get(f"{mlflow_ui}/#/models/{MODEL}/versions/{v}")
        wait_for(d, lambda t: f"Version {v}" in t and "Source Run" in t and "promote-" in t and "@ challenger" in t,
                 "the version page with its source run and alias")
        _close_assistant(d)
        screenshot(d, "mlflow_version")
        link = d.find_element("css selector", f"a[href*='{mv.run_id}']")
        link.click()
        wait_for_all(d, ["promote-", "Parent run", "promote.decision"], "the run that registered the version")
        assert mv.run_id in d.current_url
