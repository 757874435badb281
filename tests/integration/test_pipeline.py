"""The quick profile end to end through Prefect -> DVC -> MLflow, in a real git + DVC repo in a tmp dir.

One module-scoped project is shared by the tests below, in order: a flow killed mid-stage and
restarted (which is also the end-to-end run whose lineage is checked), a no-op ``dvc repro``, the
set of stages a param change invalidates, and finally bad rows that stop the pipeline at the gate.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

pytestmark = pytest.mark.integration

from projectkit import REPO, copy_project, init_repos  # noqa: E402


def _run(cmd, cwd, **kw):
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=True, **kw)


@pytest.fixture(scope="module")
def project(tmp_path_factory, prefect_api):
    root = tmp_path_factory.mktemp("project")
    copy_project(root)
    store = root / "mlflow.db"
    old = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{store}"  # before env is copied: the flow subprocess too
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "DVC_NO_ANALYTICS": "1"}
    init_repos(root, env)
    yield {"root": root, "wd": root / "runs" / "quick", "api": prefect_api, "env": env}
    if old is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = old


def _lock(wd: Path) -> dict:
    p = wd / "dvc.lock"
    return yaml.safe_load(p.read_text())["stages"] if p.exists() else {}


@pytest.mark.timeout(1200)
def test_killed_flow_resumes_and_records_lineage(project):
    root, wd = project["root"], project["wd"]
    env = {**project["env"], "PREFECT_API_URL": project["api"], "PYTHONPATH": str(root)}
    proc = subprocess.Popen([sys.executable, "-m", "flows.self_improve", "--profile", "quick"], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    t0 = time.time()
    for line in proc.stdout:  # wait until SFT has started, then pull the plug on the whole group
        seen.append(line)
        if "Running stage 'sft-1'" in line:
            time.sleep(3)
            break
        assert time.time() - t0 < 300, "".join(seen[-40:])
    else:
        pytest.fail("flow ended before sft started:\n" + "".join(seen[-60:]))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    lock = _lock(wd)
    assert "validate-1" in lock and "sft-1" not in lock
    assert not (wd / "models/iter_1/sft").exists(), "a killed stage must leave no output behind"

    from flows.self_improve import self_improve

    t1 = time.time()
    summary = self_improve(profile="quick", repo=str(root))
    resume_s = time.time() - t1
    executed = {s["stage"]: s["executed"] for s in summary["iterations"][0]["stages"]}
    assert not any(executed[s] for s in ["prepare-base", "benchmark", "synth-1", "teacher-rollout-1", "validate-1"]), executed
    assert all(executed[s] for s in ["sft-1", "rl-1", "distill-1", "evaluate-1", "promote-1", "report-1"]), executed
    it2 = {s["stage"]: s["executed"] for s in summary["iterations"][1]["stages"]}
    assert all(it2[f"{s}-2"] for s in ["synth", "sft", "rl", "evaluate", "promote"]), it2
    print(f"resume after kill: {resume_s:.1f} s")

    # ---- lineage ------------------------------------------------------------------------------
    from mlflow import MlflowClient

    from apprentice.ops import dvcgen, lineage

    c = MlflowClient()
    exp = c.get_experiment_by_name("apprentice")
    parents = c.search_runs([exp.experiment_id], "tags.`apprentice.iteration` = '1' and tags.`mlflow.runName` = 'iter-1'")
    status = sorted(r.info.status for r in parents if "mlflow.parentRunId" not in r.data.tags)
    assert status == ["FINISHED", "KILLED"], status  # the interrupted attempt is closed, not left RUNNING
    parent = summary["iterations"][0]["parent_run_id"]
    nested = c.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent}'")
    names = {r.info.run_name: r for r in nested}
    assert set(names) == {"prepare-base", "benchmark", *(f"{s}-1" for s in
                          ["frontier", "synth", "evolve", "teacher-rollout", "validate", "loop-data", "sft", "rl", "distill", "evaluate",
                           "promote", "report"])}
    assert "pass_rate.gen_0" in c.get_run(names["evolve-1"].info.run_id).data.metrics  # generations measured
    sft = names["sft-1"]
    assert sft.data.params["sft.max_steps"] and sft.data.tags["dvc.executed"] == "True"
    assert len(c.get_metric_history(sft.info.run_id, "loss")) >= 1, "per-step metrics from the DVCLive files"
    lock = _lock(wd)
    sft_in = {d.dataset.name: d.dataset.digest for d in sft.inputs.dataset_inputs}
    md5 = next(d["md5"] for d in lock["sft-1"]["deps"] if d["path"] == "data/iter_1/train.parquet")  # loop-data's
    assert sft_in["data/iter_1/train.parquet"] == md5[:32], "datasets carry the DVC md5"
    assert "models/iter_1/sft" in sft_in  # the output, by reference
    assert c.get_run(parent).data.tags["git.commit"] != "unknown"

    # ---- the loop builds on its champion ----------------------------------------------------------
    name = "apprentice-agent"
    promo1 = json.loads((wd / "reports/iter_1/promotion.json").read_text())
    aliases = lineage.aliases(name)
    assert aliases["challenger"] == "2"  # iteration 2's candidate was registered too
    base_rate = json.loads((wd / "data/benchmark/eval/base.json").read_text())["success_rate"]
    if "champion" in aliases:  # the alias only ever names a model that beat what it replaced
        champ = lineage.alias_version(name, "champion")
        assert float(champ["tags"]["success_rate"]) > base_rate
    else:  # the tiny random model beats nothing: the base model stays the start model
        assert promo1["champion"]["kind"] == "base" and not promo1["promoted"]
    start2 = json.loads((wd / "reports/iter_2/sft_start.json").read_text())["start_model"]
    assert start2["path"] == promo1["champion"]["weights_path"] and start2["md5"] == promo1["champion"]["md5"]
    assert start2["md5"] and c.get_run(next(r for r in c.search_runs(
        [exp.experiment_id], "tags.`mlflow.runName` = 'sft-2'")).info.run_id).data.tags["start_model.md5"] == start2["md5"]
    # one benchmark for both iterations: base evaluated once (no iter_k copy), every model scored on it
    assert not (wd / "data/iter_1/eval/base.json").exists() and not (wd / "data/iter_1/eval_problems.parquet").exists()
    assert lock[dvcgen.eval_stage("rl", 2)]["deps"] and any(d["path"] == "data/benchmark/problems.parquet"
                                                 for d in lock[dvcgen.eval_stage("rl", 2)]["deps"])
    table = (wd / "reports/iter_2/curves/eval.md").read_text()
    assert "iter 1 rl" in table and "iter 2 rl" in table and table.count("\nbase ") == 1
    mv = c.get_model_version(name, "1")
    assert mv.run_id == names["promote-1"].info.run_id
    cand = promo1["candidate"]  # the model it registered: promote.candidate, or an alternate that won
    producer = {"sft": "sft-1", "rl": "rl-1", "student": "distill-1"}[cand]
    cand_md5 = next(o["md5"] for o in lock[producer]["outs"] if o["path"] == f"models/iter_1/{cand}")
    assert mv.tags["dvc_md5"] == cand_md5 and mv.tags["weights_path"] == f"models/iter_1/{cand}"
    # the generation scheduler probed evolved generation 0 and fed it to RL (quick: curriculum.evolve.feed 2)
    feed = json.loads((wd / "models/iter_1/rl/curriculum.json").read_text())["evolve_feed"]
    assert feed["history"][0][0] == 0 and feed["generation"] in range(feed["n"])
    assert (wd / "reports/iter_1/curves/sft.png").stat().st_size > 1000
    assert (wd / "reports/iter_1/gate.html").exists()
    # DVC reads the DVCLive files as they are: the training curves and their last values
    plots = json.loads(_run([sys.executable, "-m", "dvc", "plots", "show", "--json"], wd, env=project["env"]).stdout)
    loss = plots["data"]["models/iter_1/sft/dvclive/plots/metrics/loss.tsv"]
    assert [float(p["loss"]) for d in loss for p in d["content"]["data"]["values"]]
    shown = json.loads(_run([sys.executable, "-m", "dvc", "metrics", "show", "--json"], wd, env=project["env"]).stdout)
    assert "loss" in json.dumps(shown) and "models/iter_2/rl/dvclive/metrics.json" in json.dumps(shown)


def test_noop_repro_reruns_nothing(project):
    t = time.time()
    out = _run([sys.executable, "-m", "dvc", "repro"], project["wd"], env={**project["env"],
               "PYTHONPATH": str(project["root"])}).stdout
    noop_s = time.time() - t
    assert "Running stage" not in out, out
    print(f"no-op dvc repro: {noop_s:.2f} s")


def test_rl_param_change_invalidates_only_rl_and_after(project):
    from apprentice.ops import dvcgen

    wd = project["wd"]
    params = wd / "params.yaml"
    before = params.read_text()
    raw = yaml.safe_load(before)
    raw["rl"]["learning_rate"] = raw["rl"]["learning_rate"] * 2
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    try:
        status = json.loads(_run([sys.executable, "-m", "dvc", "status", "--json"], wd, env=project["env"]).stdout)
        out = _run([sys.executable, "-m", "dvc", "repro", "--dry"], wd, env=project["env"]).stdout
    finally:
        params.write_text(before)
    assert set(status) == {"rl-1", "rl-2"}, status  # only rl's own params changed
    would_run = {line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage")}
    assert "rl-1" in would_run and not would_run & {"prepare-base", "benchmark", "evaluate-base", "synth-1",
                                                    "teacher-rollout-1", "validate-1", "sft-1", dvcgen.eval_stage("sft", 1),
                                                    "evolve-1"}, would_run  # base/sft evals stay cached


def test_bad_rows_stop_the_flow_at_the_gate(project):
    """Bad teacher rows (recorded as that stage's output) make validate fail; sft never runs."""
    root, wd = project["root"], project["wd"]
    teacher = wd / "data/iter_1/teacher.parquet"
    df = pd.read_parquet(teacher)
    bad = df.iloc[:3].copy()
    bad["messages"] = "{not json"
    pd.concat([df, df.iloc[:2], bad]).to_parquet(teacher, index=False)  # + duplicates + broken rows
    _run([sys.executable, "-m", "dvc", "commit", "-f", "teacher-rollout-1"], wd, env=project["env"])
    sft_mtime = (wd / "models/iter_1/sft").stat().st_mtime

    from mlflow import MlflowClient

    from flows.self_improve import self_improve
    from tasks._dvc import StageFailed

    with pytest.raises(StageFailed, match="validate-1"):
        self_improve(profile="quick", repo=str(root))
    assert (wd / "models/iter_1/sft").stat().st_mtime == sft_mtime
    page = (wd / "reports/iter_1/gate.html").read_text()
    assert "FAILED" in page and "_messages_ok" in page
    c = MlflowClient()
    exp = c.get_experiment_by_name("apprentice")
    last = c.search_runs([exp.experiment_id], "tags.`mlflow.runName` = 'iter-1'", order_by=["start_time DESC"])[0]
    assert last.info.status == "FAILED"
    nested = {r.info.run_name: r.info.status for r in
              c.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{last.info.run_id}'")}
    assert nested.get("validate-1") == "FAILED" and "sft-1" not in nested, nested


def test_deployment_definition_loads():
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.flows import load_flow_from_entrypoint

    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    dep = next(d for d in spec["deployments"] if d["name"] == "nightly")
    flow = load_flow_from_entrypoint(str(REPO / dep["entrypoint"].split(":")[0]) + ":" + dep["entrypoint"].split(":")[1])
    flow.validate_parameters(dep["parameters"])
    assert dep["concurrency_limit"] == 1
    assert CronSchedule(cron=dep["schedules"][0]["cron"], timezone="UTC").cron == "0 2 * * *"
