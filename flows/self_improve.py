"""The self-improvement loop: ``python -m flows.self_improve --profile default|quick|long``.

For each iteration declared in the params (``pipeline.iterations``): one MLflow parent run, then one
Prefect task per stage, in the stage registry's order (:mod:`apprentice.pipeline`): before iteration 1
prepare-base and benchmark; then synth, evolve (only when a consumer reads its output), teacher-rollout,
validate (the data gate), loop-data, sft, rl, distill, evaluate (one task per model), promote, report.
Each task runs
its DVC stage (``dvc repro --single-item``) inside a nested MLflow run, so:

* **resumable**: after an interruption, rerunning the flow skips every stage whose outputs are
  complete in ``dvc.lock`` (stages write atomically; an interrupted stage left no output) and the
  interrupted attempt's MLflow runs are marked KILLED;
* **gated**: a failed ``validate`` raises, so nothing downstream runs;
* **reproducible without it**: ``dvc repro`` in the profile's work dir runs the same stages.

Without ``PREFECT_API_URL`` Prefect starts a temporary local server for the run (``PREFECT_HOME``
defaults to ``<repo>/.prefect``); schedules need ``make serve`` (see ``prefect.yaml``).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

# Settings Prefect reads at import: a writable home in the project, no telemetry, a startup timeout
# that survives a loaded 2-core machine. setdefault: the caller's environment wins.
os.environ.setdefault("PREFECT_HOME", str(REPO / ".prefect"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")

from prefect import flow  # noqa: E402

from apprentice import pipeline  # noqa: E402
from apprentice.config import load_config  # noqa: E402
from apprentice.ops import dvcgen, lineage, runlock  # noqa: E402
from apprentice.paths import Paths  # noqa: E402
from tasks import failures, parallel  # noqa: E402
from tasks._dvc import StageContext, stage_env  # noqa: E402
from tasks.stages import stage_task  # noqa: E402


def stage_order(iteration: int, params: Any = None) -> list[str]:
    """The stages the flow runs in iteration ``iteration``, in order (the registry's order; the
    once-stages, such as the base model and the fixed benchmark, before iteration 1 only). With
    ``params`` only the stages those params run, exactly as ``dvc.yaml`` declares them (``evolve`` runs
    only when a consumer reads its output)."""
    return (pipeline.once_stages(params) if iteration == 1 else []) + pipeline.iteration_stages(params)


@flow(name="self-improve", log_prints=True)
def self_improve(profile: str = "default", repo: str | None = None) -> dict:
    """Run every iteration of ``profile`` through DVC, with lineage in MLflow; returns a summary."""
    root = Path(repo).resolve() if repo else REPO
    with runlock.hold(dvcgen.workdir(profile, root), profile):  # a second flow here exits at once
        return _run(profile, root)


def _run(profile: str, root: Path) -> dict:
    os.environ["APPRENTICE_FLOW_RUN"] = flow_run = uuid.uuid4().hex  # tags this run's lines in resources.jsonl
    t_flow = time.perf_counter()
    wd = dvcgen.write(profile, root)
    cfg = load_config(wd / "params.yaml")
    uri = lineage.configure(cfg.lineage.tracking_uri, cfg.lineage.experiment, wd)
    summary: dict = {"profile": profile, "workdir": str(wd), "tracking_uri": uri, "iterations": []}
    for k in range(1, cfg.pipeline.iterations + 1):
        with lineage.iteration_run(k, profile, root, wd / "params.yaml") as parent:
            ctx = StageContext(str(root), str(wd), profile, k, parent)
            once = StageContext(str(root), str(wd), profile, None, parent)  # once for all iterations
            stages = []
            for s in stage_order(k, cfg):
                stage = pipeline.get(s)
                if stage.models and cfg.rollout.engine == "ray" and cfg.ray.parallel_evaluations:
                    # the per-model evaluations run concurrently on Ray (tasks/parallel.py); the task below
                    # then finds them up to date in dvc.lock and records them in MLflow as usual
                    parallel.repro_parallel([f"dvc.yaml:{t}" for t in dvcgen.dvc_stages(s, k)], wd,
                                            stage_env(root, None), cfg.ray.address)
                stages.append(stage_task(s)(ctx if stage.per_iteration else once))
            promo = next(s["result"] for s in stages if s["stage"] == f"promote-{k}")
            lineage.log_artifacts(parent, [Paths(wd, k).report_page])  # the iteration's page
            lineage.set_tags(parent, {"promote.promoted": bool(promo.get("promoted")),
                                      "dvc.executed_stages": ",".join(s["stage"] for s in stages if s["executed"])})
        summary["iterations"].append({"iteration": k, "parent_run_id": parent, "stages": stages})
    print(wall_time_table(summary["iterations"]))
    print(where_to_look(wd, uri, cfg.pipeline.iterations))
    print(f"  MLflow store:    {lineage.store_summary(cfg.lineage.experiment, cfg.promote.registered_model)}")
    print(resource_table(wd, flow_run, time.perf_counter() - t_flow))
    return summary


def resource_table(wd: Path, flow_run: str, total_s: float) -> str:
    """Per-stage wall time and peak RSS of this flow run (stages DVC skipped do not appear)."""
    import json

    log = Paths(wd).resources_log
    rows = []
    if log.exists():
        for line in log.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if r.get("flow_run") == flow_run:
                rows.append(r)
    out = ["\n=== per-stage wall time and peak RSS (this run; cached stages not listed) ===",
           f"{'stage':28s} {'iter':>4s} {'wall s':>8s} {'peak RSS GB':>12s}"]
    out += [f"{r['stage']:28s} {r['iteration']:>4d} {r['wall_s']:8.1f} {r['peak_rss_gb']:12.2f}" for r in rows]
    per_iter: dict[int, float] = {}
    for r in rows:
        per_iter[r["iteration"]] = per_iter.get(r["iteration"], 0.0) + r["wall_s"]
    out.append("stages' own time per iteration: " + ", ".join(f"iter {k}: {v / 60:.1f} min" for k, v in sorted(per_iter.items())))
    out.append(f"whole flow (with DVC, Prefect, MLflow overhead): {total_s / 60:.1f} min; "
               f"peak RSS of any stage: {max((r['peak_rss_gb'] for r in rows), default=0):.2f} GB")
    threads = sorted({r["torch_threads"] for r in rows if "torch_threads" in r})
    if threads:  # a reproduction gets the same outputs at the same dtype *and* thread count (docs/operations.md)
        out.append(f"torch threads per stage: {', '.join(map(str, threads))} (another machine reproduces these "
                   "outputs at the same dtype and thread count: set model.threads)")
    return "\n".join(out)


def wall_time_table(iterations: list[dict]) -> str:
    """Per stage: wall time (DVC + MLflow logging included) and whether it ran or DVC skipped it."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="wall time per stage")
    for col, j in (("stage", "left"), ("ran", "left"), ("wall", "right"), ("share", "right")):
        table.add_column(col, justify=j)  # type: ignore[arg-type]
    rows = [s for it in iterations for s in it["stages"]]
    total = sum(s.get("wall_s", 0.0) for s in rows) or 1.0
    for s in rows:
        w = s.get("wall_s", 0.0)
        table.add_row(s["stage"], "ran" if s["executed"] else "skipped (unchanged)", f"{w / 60:.1f} min" if w >= 60
                      else f"{w:.1f} s", f"{100 * w / total:.0f}%")
    table.add_row("total", "", f"{total / 60:.1f} min", "100%", end_section=True)
    buf = io.StringIO()
    Console(file=buf, width=100, color_system=None).print(table)
    return buf.getvalue()


def where_to_look(wd: Path, uri: str, k: int) -> str:
    at = Paths(wd, k)
    md = at.curves_dir / "eval.md"
    table = md.read_text() if md.exists() else "(none)"
    promo = at.promotion.read_text() if at.promotion.exists() else "{}"
    pngs = sorted(str(p) for p in at.curves_dir.glob("*.png"))
    return "\n".join([
        f"\n=== evaluation, iteration {k} (held-out problems) ===", table.rstrip(),
        f"\npromotion: {_promotion_line(promo)}",
        "\nwhere to look:",
        f"  MLflow UI:      mlflow ui --backend-store-uri {uri} --port 5000   (then http://127.0.0.1:5000)",
        f"  iteration report: {at.report_page}   (self-contained; open it in any browser)",
        f"  gate report:    {at.gate_html}",
        f"  learning curves: {', '.join(pngs) or '(none)'}",
        f"  promotion:      {at.promotion}",
        f"  DVC:            cd {wd} && dvc metrics show && dvc plots show  (dvc.yaml, dvc.lock)",
    ])


def _promotion_line(text: str) -> str:
    import json

    p = json.loads(text or "{}")
    if not p:
        return "(none)"
    verdict = "promoted to champion" if p.get("promoted") else "registered as challenger; champion kept"
    return f"{p.get('registered_model')} v{p.get('version')} ({p.get('candidate')}) {verdict}: {p.get('reason')}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flows.self_improve", description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="default", help="params profile: default or one in apprentice/profiles/")
    p.add_argument("--debug", action="store_true", help="keep Prefect's tracebacks (also APPRENTICE_DEBUG=1)")
    args = p.parse_args(argv)
    if not failures.debug_requested(args.debug):
        failures.quiet_prefect()
    try:  # before Prefect starts its server: a second run leaves at once (the flow takes the lock itself)
        with runlock.hold(dvcgen.workdir(args.profile, REPO), args.profile):
            pass
    except runlock.RunInProgress as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    try:
        self_improve(profile=args.profile)
    except Exception as e:  # the stage output above already shows the details
        if isinstance(e, failures.StageFailed):
            print(f"\nflow failed: {e}", file=sys.stderr)
        else:
            print(f"\nflow failed: {e.__class__.__name__}: {str(e)[-3000:]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
