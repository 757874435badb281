"""Training curves through DVCLive: the files DVC plots, their resume, their side effects, their readers.

The trainer-level check (a real SFT run on the tiny model, killed and resumed) is in
tests/integration/test_training.py; here the callback is driven with the states the trainer passes,
so a resume, a kill mid-line and DVCLive's repository handling are checked in a second.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from apprentice import pipeline
from apprentice.ops import dvcgen
from apprentice.training import common, curves, loggers

LOSSES, TOKENS = [0.5, 0.25, 0.125], [100.0, 210.0, 330.0]


def _state(step: int) -> SimpleNamespace:
    return SimpleNamespace(global_step=step, is_world_process_zero=True)


def _log(cbs, step: int, logs: dict) -> None:
    for cb in cbs:  # the order the trainers register them: MetricsCallback first
        cb.on_log(None, _state(step), None, logs=logs)


def _end(cbs, step: int) -> None:
    for cb in cbs:
        cb.on_train_end(None, _state(step), None)


def _run(work: Path, steps, *, tokens_from: float = 0.0) -> None:
    m = common.MetricsCallback(work / common.METRICS_FILE, "sft")
    cbs = [m, *[c for c in loggers.callbacks("sft", m) if isinstance(c, loggers.DVCLiveLogger)]]
    for s in steps:
        _log(cbs, s, {"loss": LOSSES[s - 1], "num_tokens": TOKENS[s - 1] - tokens_from, "learning_rate": 1e-4})
    _log(cbs, steps[-1], {"train_loss": LOSSES[-1], "train_runtime": 1.5, "epoch": 1.0})
    _end(cbs, steps[-1])


def test_resumed_training_appends_to_the_dvclive_curves(tmp_path):
    """Steps 1-3 in one go == steps 1-3, a kill (a half TSV line), resume from checkpoint 2, step 3 again."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    _run(whole, [1, 2, 3])
    live = whole / curves.DVCLIVE_DIR
    assert (live / "plots/metrics/loss.tsv").read_text() == "step\tloss\n1\t0.5\n2\t0.25\n3\t0.125\n"
    summary = curves.summary(live)
    assert summary["step"] == 3 and summary["loss"] == 0.125 and summary["num_tokens"] == 330.0
    assert summary["train"]["loss"] == pytest.approx(sum(LOSSES) / 3)  # MetricsCallback's run-wide train_loss
    assert "train_runtime" not in summary  # wall clock stays out of the DVC output
    assert not (live / "dvc.yaml").exists() and not (live / "params.yaml").exists()

    _run(resumed, [1, 2, 3])
    with (resumed / curves.DVCLIVE_DIR / "plots/metrics/loss.tsv").open("a") as f:
        f.write("4\t0.06")  # a kill in the middle of a line (step 4 never reached a checkpoint)
    common.trim_metrics(resumed / common.METRICS_FILE, "sft", 2)
    _run(resumed, [3], tokens_from=TOKENS[1])  # the restarted trainer counts tokens from zero

    def files(d: Path) -> dict[str, str]:
        return {p.relative_to(d).as_posix(): p.read_text() for p in sorted(d.rglob("*")) if p.is_file()}

    assert files(resumed / curves.DVCLIVE_DIR) == files(live)  # byte for byte: steps continue, counters too
    rows = curves.read_dvclive(live)
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["num_tokens"] for r in rows] == TOKENS
    assert rows[-1]["train/loss"] == pytest.approx(sum(LOSSES) / 3)


def test_dvclive_makes_no_experiment_commit_or_dvc_repo(tmp_path, monkeypatch):
    """In a Git repo without DVC (a user's script) and under `dvc repro` (DVC_ROOT set), DVCLive only writes
    its files: no `dvc init`, nothing staged, no experiment ref, no dvc.yaml of its own.

    Contract for the ``Live._init_dvc`` override (dvclive pinned exactly): stock ``Live()`` runs
    ``dvc init`` in an enclosing Git repo; ours must not."""
    from dvclive import Live

    assert callable(getattr(Live, "_init_dvc", None)), "dvclive moved Live._init_dvc: re-read loggers._stage_live"
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]

    def out(*cmd: str) -> list[str]:
        return subprocess.run([*git, *cmd], capture_output=True, text=True, check=True).stdout.splitlines()

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "README").write_text("x")
    out("add", "README")
    out("commit", "-qm", "init")
    monkeypatch.chdir(tmp_path)
    _run(tmp_path / "work", [1, 2])
    assert not (tmp_path / ".dvc").exists(), "DVCLive initialised DVC in a Git repo"
    assert out("status", "--porcelain") == ["?? work/"]

    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=tmp_path, check=True)
    out("commit", "-qm", "dvc init")
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))  # what `dvc repro` sets for a stage's command
    _run(tmp_path / "work", [1, 2])
    assert out("status", "--porcelain") == ["?? work/"]  # .dvc/tmp (DVCLive's VS Code signal) is DVC-ignored
    assert len(out("log", "--oneline", "--all")) == 2  # no experiment commit
    assert out("for-each-ref", "refs/exps") == []
    assert not list((tmp_path / ".dvc" / "tmp").rglob("DVCLIVE_STEP_COMPLETED"))  # signal cleared at the end
    assert sorted(p.name for p in (tmp_path / "work" / curves.DVCLIVE_DIR).iterdir()) == ["metrics.json", "plots"]


def test_read_dvclive_nested_names_and_torn_lines(tmp_path):
    d = tmp_path / "dvclive" / "plots" / "metrics"
    (d / "rewards").mkdir(parents=True)
    (d / "loss.tsv").write_text("step\tloss\n1\t2.0\n2\t1.5\n3\t1.")
    (d / "rewards" / "mean.tsv").write_text("step\tmean\n2\t0.25\n")
    assert curves.read_dvclive(tmp_path / "dvclive") == [
        {"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5, "rewards/mean": 0.25}, {"step": 3, "loss": 1.0}]
    curves.trim_dvclive(tmp_path / "dvclive", 1)
    assert curves.read_dvclive(tmp_path / "dvclive") == [{"step": 1, "loss": 2.0}]
    assert curves.read_dvclive(tmp_path / "missing") == []


def test_lineage_logs_step_metrics_from_the_dvclive_files(tmp_path, monkeypatch):
    """MLflow's charts come from the same files DVC plots. A real MLflow store, on files: a fresh sqlite
    store runs slow migrations first; the pipeline test checks the same through the flow on sqlite."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    from mlflow import MlflowClient

    from apprentice.ops import lineage

    _run(tmp_path / "sft", [1, 2, 3])
    client = MlflowClient()
    exp = client.create_experiment("curves")
    run = client.create_run(exp)
    n = lineage.log_step_metrics(run.info.run_id, curves.read_dvclive(tmp_path / "sft" / curves.DVCLIVE_DIR))
    assert n == 3 * 3 + 2  # loss, num_tokens, learning_rate per step; train/loss and epoch at the end
    hist = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in hist) == [(1, 0.5), (2, 0.25), (3, 0.125)]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [3]


def test_dvc_yaml_declares_the_dvclive_plots_and_metrics():
    from apprentice.config import load_raw

    raw = load_raw(dvcgen.REPO / "params.yaml")
    raw["pipeline"]["iterations"] = 2
    doc = dvcgen.pipeline(raw, repo=dvcgen.REPO)
    plots = [next(iter(p)) for p in doc["plots"]]
    for k in (1, 2):
        for out in (s.curve for s in pipeline.curve_stages()):
            assert f"models/iter_{k}/{out}/dvclive/plots/metrics" in plots
            assert f"models/iter_{k}/{out}/dvclive/metrics.json" in doc["metrics"]
    assert not [p for p in plots if p.endswith(".csv")]  # no converted copies any more
    report_deps = doc["stages"]["report-1"]["deps"]
    assert "models/iter_1/sft/dvclive" in report_deps and not [d for d in report_deps if d.endswith(".jsonl")]


def test_dvc_plots_show_renders_the_dvclive_curve(tmp_path, monkeypatch):
    """`dvc plots show` (DVC's CLI) and DVC's metrics on a repo whose dvc.yaml declares a
    DVCLive folder the way dvcgen does."""
    from dvc.cli import main as dvc

    _run(tmp_path / "models" / "sft" / "_work", [1, 2, 3])
    shutil.move(tmp_path / "models" / "sft" / "_work" / curves.DVCLIVE_DIR, tmp_path / "models" / "sft")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    assert dvc(["init", "--no-scm", "-q"]) == 0
    (tmp_path / "dvc.yaml").write_text(
        "plots:\n- models/sft/dvclive/plots/metrics:\n    x: step\nmetrics:\n- models/sft/dvclive/metrics.json\n")
    # the CLI in a subprocess: in-process, DVC's console keeps the stdout of whichever test used it first
    shown = subprocess.run([sys.executable, "-m", "dvc", "plots", "show", "--json"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr
    loss = json.loads(shown.stdout)["data"]["models/sft/dvclive/plots/metrics/loss.tsv"]
    points = [(int(p["step"]), float(p["loss"])) for d in loss for p in d["content"]["data"]["values"]]
    assert points == [(1, 0.5), (2, 0.25), (3, 0.125)]
    from dvc.repo import Repo

    shown = Repo(str(tmp_path)).metrics.show()  # what `dvc metrics show` / `dvc exp show` print
    (workspace,) = shown.values()  # one revision: the workspace ("" without Git)
    metrics = workspace["data"]["models/sft/dvclive/metrics.json"]["data"]
    assert metrics == curves.summary(tmp_path / "models/sft/dvclive") and metrics["loss"] == 0.125
