"""Stage ``report``: learning curves and the evaluation table of iteration k, readable offline.

Training stages write ``metrics.jsonl`` next to their model; DVC plots cannot read JSONL, so this
stage writes ``reports/iter_k/curves/<stage>.csv`` (the DVC plots declared in ``dvc.yaml``), renders
each as a PNG with ``vl-convert`` (bundled Vega, no CDN, no browser) and writes ``eval.md``, the
evaluation table of every policy evaluated this iteration.

It also writes ``reports/iter_k/index.html`` (:mod:`apprentice.report_html`): the one page that shows
the iteration (learning table, breakdowns, curves, gate, promotion, lineage, champion trend). Under
the Prefect flow (``MLFLOW_RUN_ID`` set) the page lists the iteration's MLflow run ids; the flow logs
it as an artifact of the report run and of the iteration run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from apprentice.config import Config
from apprentice.paths import Paths, atomic_path

CURVES = {"sft": "sft", "rl": "rl", "distill": "student"}
TABLE_COLUMNS = ["success_rate", "success_ci_low", "success_ci_high", "mean_reward", "truncation_rate",
                 "mean_turns", "episodes"]


def curve_frame(jsonl: Path) -> pd.DataFrame:
    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()] if jsonl.exists() else []
    df = pd.DataFrame(rows)
    if df.empty:
        return pd.DataFrame({"step": [], "loss": []})
    if "step" not in df.columns:
        df["step"] = df["global_step"] if "global_step" in df.columns else range(len(df))
    keep = ["step"] + [c for c in df.columns if c != "step" and pd.api.types.is_numeric_dtype(df[c])
                       and not pd.api.types.is_bool_dtype(df[c])]
    return df[keep]


def _chart(df: pd.DataFrame, title: str) -> dict[str, Any]:
    cols = [c for c in df.columns if c != "step"]
    return {"$schema": "https://vega.github.io/schema/vega-lite/v5.json", "title": title,
            "data": {"values": json.loads(df.to_json(orient="records"))},
            "transform": [{"fold": cols, "as": ["metric", "value"]}, {"filter": "isValid(datum.value)"}],
            "facet": {"row": {"field": "metric", "type": "nominal"}},
            "spec": {"width": 420, "height": 110, "mark": {"type": "line", "point": True},
                     "encoding": {"x": {"field": "step", "type": "quantitative"},
                                  "y": {"field": "value", "type": "quantitative", "scale": {"zero": False}}}},
            "resolve": {"scale": {"y": "independent"}}}


def eval_table(eval_dir: Path) -> str:
    rows = []
    for js in sorted(eval_dir.glob("*.json")):
        m = json.loads(js.read_text())
        rows.append({"policy": js.stem, **{c: m.get(c) for c in TABLE_COLUMNS if c in m}})
    if not rows:
        return "(no evaluation results)\n"
    return pd.DataFrame(rows).set_index("policy").to_string(float_format="%.3f") + "\n"


def run(cfg: Config, paths: Paths, **_: Any) -> dict[str, Any]:
    out = paths.reports / "curves"
    written = []
    with atomic_path(out) as tmp:
        tmp.mkdir(parents=True)
        for name, model in CURVES.items():
            df = curve_frame(paths.models / model / "metrics.jsonl")
            df.to_csv(tmp / f"{name}.csv", index=False)
            if len(df) and len(df.columns) > 1:
                import vl_convert as vlc

                spec = _chart(df, f"iteration {paths.iteration}: {name}")
                (tmp / f"{name}.png").write_bytes(vlc.vegalite_to_png(spec, scale=1.5))
                written.append(str(out / f"{name}.png"))
        (tmp / "eval.md").write_text(eval_table(paths.eval_dir))
    print((out / "eval.md").read_text())
    page = write_page(paths)
    print(f"iteration report: {page}")
    return {"curves": written, "eval_table": str(out / "eval.md"), "report": str(page)}


def write_page(paths: Paths) -> Path:
    """``reports/iter_k/index.html``, with the MLflow run ids when the flow runs this stage."""
    import os

    from apprentice import lineage, report_html

    run_id = os.environ.get("MLFLOW_RUN_ID")
    runs = lineage.iteration_runs(run_id) if run_id else {}
    if runs and os.environ.get("APPRENTICE_MLFLOW_UI"):
        runs["ui_url"] = os.environ["APPRENTICE_MLFLOW_UI"]
    return report_html.write(paths, runs, lineage.git_commit(paths.root))
