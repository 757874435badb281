"""Stage ``report``: learning curves and the benchmark table of iterations 1..k, readable offline.

Training stages log their curves through DVCLive into ``<model>/dvclive`` (``dvc.yaml`` declares
those files as DVC plots and metrics, so ``dvc plots show/diff`` and ``dvc exp show`` need nothing
from here). This stage renders each stage's curves as a PNG with ``vl-convert`` (bundled Vega, no
CDN, no browser; the one plotting stack of the project) and writes ``eval.md``: one row
per model per iteration on the fixed benchmark (the base model once), which model is champion after
each promotion, and the paired test of this iteration's champion against the previous one's.

It also writes ``reports/iter_k/index.html`` (:mod:`apprentice.ops.report_html`): the one page that shows
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
from apprentice.paths import Paths, atomic_path, eval_jsons
from apprentice.training import curves

CURVES = {"sft": "sft", "rl": "rl", "distill": "student"}
TABLE_COLUMNS = ["success_rate", "success_ci_low", "success_ci_high", "mean_reward", "truncation_rate",
                 "mean_turns", "episodes"]


def curve_frame(source: Path) -> pd.DataFrame:
    """A stage's curves: its DVCLive folder (a directory), or a metrics JSONL file."""
    if source.is_dir():
        rows = curves.read_dvclive(source)
    else:
        rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()] if source.exists() else []
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
    """The table of the evaluations in one folder (one row per ``<policy>.json``)."""
    return _table([(js.stem, js) for js in eval_jsons(eval_dir)])


def _table(files: list[tuple[str, Path]]) -> str:
    rows = []
    for label, js in files:
        m = json.loads(js.read_text())
        rows.append({"model": label, **{c: m.get(c) for c in TABLE_COLUMNS if c in m}})
    if not rows:
        return "(no evaluation results)\n"
    return pd.DataFrame(rows).set_index("model").to_string(float_format="%.3f") + "\n"


_ORDER = ("sft", "rl", "student")


def benchmark_table(paths: Paths) -> str:
    """Every model of iterations 1..k on the benchmark: base once, then each iteration's models in order."""
    files = [("base", f) for f in [paths.eval_metrics("base")] if f.exists()]
    for j in range(1, paths.iteration + 1):
        d = Paths(paths.root, j).eval_dir
        known = sorted(eval_jsons(d), key=lambda f: (_ORDER.index(f.stem) if f.stem in _ORDER else 9, f.stem))
        files += [(f"iter {j} {f.stem}", f) for f in known]
    return _table(files)


def episodes_of(entry: dict[str, Any], paths: Paths) -> Path:
    """The benchmark episodes of a promotion record's ``champion`` entry."""
    if entry.get("kind") == "base":
        return paths.eval_episodes("base")
    return Paths(paths.root, int(entry["iteration"])).eval_episodes(entry["kind"])


def model_comparisons(paths: Paths) -> str:
    """Per iteration, on the benchmark: RL vs SFT (exact McNemar) and the student's success as a share
    of its teacher's (the RL model), with a paired bootstrap interval and the parameter ratio."""
    from apprentice.data.trajectories import read_parquet
    from apprentice.evaluation.metrics import paired_test, success_ratio

    lines = []
    for j in range(1, paths.iteration + 1):
        pj = Paths(paths.root, j)
        tables = {m: read_parquet(pj.eval_episodes(m)) for m in ("sft", "rl", "student") if pj.eval_episodes(m).exists()}
        if "rl" in tables and "sft" in tables:
            t = paired_test(tables["rl"], tables["sft"])
            lines.append(f"iter {j} rl vs sft: {t['success_rate_a']:.3f} vs {t['success_rate_b']:.3f}; only rl "
                         f"{t['a_only']}, only sft {t['b_only']}; exact McNemar p = {t['p_value']:.4g}")
        if "student" in tables and "rl" in tables:
            r = success_ratio(tables["student"], tables["rl"])
            info = Paths(paths.root, j).student_record
            params = json.loads(info.read_text()).get("param_ratio") if info.exists() else None
            lines.append(f"iter {j} student / teacher (rl) success: {r['ratio']:.2f} [{r['ci_low']:.2f}, "
                         f"{r['ci_high']:.2f}] ({r['method']}); student params "
                         + (f"{100 * params:.1f} % of the teacher's" if params else "unknown"))
    return "\n".join(lines) + ("\n" if lines else "")


def champion_trend(paths: Paths) -> str:
    """Champion after each promotion, and this iteration's champion vs the previous one's (exact McNemar)."""
    from apprentice.data.trajectories import read_parquet
    from apprentice.evaluation.metrics import paired_test

    champs = []
    for j in range(1, paths.iteration + 1):
        rec = Paths(paths.root, j).promotion
        if rec.exists():
            champs.append((j, json.loads(rec.read_text())))
    if not champs:
        return ""
    lines = ["champion after each promotion:"]
    for j, rec in champs:
        c = rec.get("champion") or {}
        who = "base model" if c.get("kind") == "base" else f"v{c.get('version')} (iter {c.get('iteration')} {c.get('kind')})"
        lines.append(f"  iter {j}: {who}  [{'promoted' if rec.get('promoted') else 'kept'}: {rec.get('reason')}]")
    if len(champs) >= 2 and champs[-1][1].get("champion") and champs[-2][1].get("champion"):
        (j0, r0), (j1, r1) = champs[-2], champs[-1]
        a, b = episodes_of(r1["champion"], paths), episodes_of(r0["champion"], paths)
        if a == b:
            lines.append(f"champion iter {j1} vs iter {j0}: the same model (no challenger won)")
        elif a.exists() and b.exists():
            t = paired_test(read_parquet(a), read_parquet(b))
            lines.append(f"champion iter {j1} vs iter {j0}: {t['success_rate_a']:.3f} vs {t['success_rate_b']:.3f} on "
                         f"{t['n_pairs']} benchmark episodes; only new {t['a_only']}, only old {t['b_only']}, "
                         f"exact McNemar p = {t['p_value']:.4g}")
    return "\n".join(lines) + "\n"


def champions(paths: Paths) -> list[tuple[int, dict[str, Any], Path | None]]:
    """Per iteration 1..k with a promotion record: (iteration, the champion entry after it, the path of
    its benchmark episodes; None when the record names no champion)."""
    out = []
    for j in range(1, paths.iteration + 1):
        rec = Paths(paths.root, j).promotion
        if rec.exists():
            champ = json.loads(rec.read_text()).get("champion") or {}
            out.append((j, champ, episodes_of(champ, paths) if champ else None))
    return out


def drift_history(paths: Paths) -> list[dict[str, Any]]:
    """Per iteration 1..k with a promotion record: the champion after it, its benchmark success (with
    the Wilson interval), per-family success, and its action diversity (the policy-entropy proxy,
    :func:`apprentice.evaluation.metrics.action_diversity`): the drift guards, because iterated
    self-improvement can collapse or drift over rounds while the total success rate holds."""
    from apprentice.data.trajectories import read_parquet
    from apprentice.evaluation.metrics import action_diversity, summarize

    out = []
    for j, champ, eps in champions(paths):
        row: dict[str, Any] = {"iteration": j, "champion": "base" if champ.get("kind") == "base" else
                               f"v{champ.get('version')} (iter {champ.get('iteration')} {champ.get('kind')})"}
        if eps is not None and eps.exists():
            df = read_parquet(eps)
            m = summarize(df)
            row.update({"success_rate": m["success_rate"], "success_ci_low": m["success_ci_low"],
                        "success_ci_high": m["success_ci_high"], **action_diversity(df)})
            row.update({k: v for k, v in m.items() if k.startswith("family_") and k.endswith("/success_rate")})
        out.append(row)
    return out


def level_history(paths: Paths) -> list[dict[str, Any]]:
    """The champion after each promotion 1..k on the benchmark, per family x level: ``{iteration,
    family, level, n, successes, success}`` rows (the climb the frontier controller aims at)."""
    from apprentice.data.trajectories import read_parquet

    out: list[dict[str, Any]] = []
    levels = _benchmark_levels(paths)
    for j, _, eps in champions(paths):
        if eps is None or not eps.exists():
            continue
        df = read_parquet(eps)
        df = df.assign(level=[levels.get(str(p), -1) for p in df["problem_id"]]) if "level" not in df.columns else df
        for (fam, lv), g in df.groupby(["family", "level"]):
            out.append({"iteration": j, "family": str(fam), "level": int(lv), "n": len(g),
                        "successes": int(g["success"].astype(bool).sum()),
                        "success": float(g["success"].astype(bool).mean())})
    return out


def _benchmark_levels(paths: Paths) -> dict[str, int]:
    from apprentice.data.trajectories import read_parquet

    if not paths.benchmark.exists():
        return {}
    b = read_parquet(paths.benchmark)
    return {str(p): int(lv) for p, lv in zip(b["problem_id"], b["level"], strict=True)}


def frontier_history(paths: Paths) -> list[dict[str, Any]]:
    """Each iteration's frontier decision (``frontier.json``): per family its window, ceiling and mix."""
    out = []
    for j in range(1, paths.iteration + 1):
        rec = Paths(paths.root, j).frontier_record
        if rec.exists():
            d = json.loads(rec.read_text())
            out += [{"iteration": j, "family": f, **v} for f, v in sorted((d.get("families") or {}).items())]
    return out


def champion_chart(history: list[dict[str, Any]]) -> dict[str, Any]:
    """Vega-Lite: the champion's benchmark success per iteration (with its interval) and per family."""
    values = []
    for r in history:
        if "success_rate" not in r:
            continue
        values.append({"iteration": r["iteration"], "series": "champion (all)", "success": r["success_rate"],
                       "lo": r["success_ci_low"], "hi": r["success_ci_high"]})
        values += [{"iteration": r["iteration"], "series": k.split("/")[0].removeprefix("family_"), "success": v}
                   for k, v in r.items() if k.startswith("family_")]
    x = {"field": "iteration", "type": "ordinal"}
    y = {"field": "success", "type": "quantitative", "scale": {"domain": [0, 1]}, "axis": {"format": "%"},
         "title": "benchmark success"}
    return {"$schema": "https://vega.github.io/schema/vega-lite/v5.json", "width": 420, "height": 200,
            "title": "champion across iterations (drift guard)", "data": {"values": values},
            "layer": [{"transform": [{"filter": "isValid(datum.lo)"}], "mark": "rule",
                       "encoding": {"x": x, "y": {**y, "field": "lo"}, "y2": {"field": "hi"}}},
                      {"mark": {"type": "line", "point": True},
                       "encoding": {"x": x, "y": y, "color": {"field": "series", "type": "nominal"}}}]}


def write_drift(paths: Paths, tmp_curves: Path) -> list[dict[str, Any]]:
    """``reports/iter_k/drift.json`` (this iteration's numbers flat, for MLflow; the history) and the
    champion chart ``curves/champion.png``."""
    history = drift_history(paths)
    now = next((r for r in history if r["iteration"] == paths.iteration), {})
    flat = {f"champion_{k}": v for k, v in now.items() if isinstance(v, int | float) and k != "iteration"}
    with atomic_path(paths.drift_record) as tmp:
        tmp.write_text(json.dumps({**flat, "history": history}, indent=1, sort_keys=True) + "\n")
    if any("success_rate" in r for r in history):
        import vl_convert as vlc

        (tmp_curves / "champion.png").write_bytes(vlc.vegalite_to_png(champion_chart(history), scale=1.5))
    return history


def run(cfg: Config, paths: Paths, **_: Any) -> dict[str, Any]:
    out = paths.curves_dir
    written = []
    with atomic_path(out) as tmp:
        tmp.mkdir(parents=True)
        for name, model in CURVES.items():
            df = curve_frame(paths.models / model / curves.DVCLIVE_DIR)
            if len(df) and len(df.columns) > 1:
                import vl_convert as vlc

                spec = _chart(df, f"iteration {paths.iteration}: {name}")
                (tmp / f"{name}.png").write_bytes(vlc.vegalite_to_png(spec, scale=1.5))
                written.append(str(out / f"{name}.png"))
        write_drift(paths, tmp)
        trend, pairs = champion_trend(paths), model_comparisons(paths)
        (tmp / "eval.md").write_text(f"benchmark ({paths.benchmark.name}, the same problems in every iteration):\n"
                                     + benchmark_table(paths) + ("\n" + pairs if pairs else "")
                                     + ("\n" + trend if trend else ""))
    print((out / "eval.md").read_text())
    page = write_page(paths)
    print(f"iteration report: {page}")
    return {"curves": written, "eval_table": str(out / "eval.md"), "report": str(page)}


def write_page(paths: Paths) -> Path:
    """``reports/iter_k/index.html``, with the MLflow run ids when the flow runs this stage."""
    import os

    from apprentice.ops import lineage, report_html

    run_id = os.environ.get("MLFLOW_RUN_ID")
    runs = lineage.iteration_runs(run_id) if run_id else {}
    if runs and os.environ.get("APPRENTICE_MLFLOW_UI"):
        runs["ui_url"] = os.environ["APPRENTICE_MLFLOW_UI"]
    return report_html.write(paths, runs, lineage.git_commit(paths.root))
