"""The iteration report: ``reports/iter_k/index.html``, one self-contained page per iteration.

Why one page: the numbers that decide whether an iteration worked live in six places (evaluation
JSONs, training ``metrics.jsonl``, ``gate.json``, ``promotion.json``, ``dvc.lock``, MLflow). A
reviewer should not need a running MLflow server, DVC or network access to read them, so the page
carries everything inline: tables as HTML, charts as inline SVG rendered by ``vl-convert`` (the
Vega-Lite engine the DVC plots use, bundled, no CDN), no scripts, no external links except the
optional MLflow UI links. It opens from disk (``file://``), from an MLflow artifact view, or a CI
artifact.

Every input is optional: a stage that has not run (or a run outside the Prefect flow, which has no
MLflow run ids) leaves its section saying what is missing and how to produce it, never a crash.
Read-only over the stage outputs; :func:`write` is the only writer (atomic).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import html
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from apprentice.paths import Paths, atomic_path, eval_jsons
from apprentice.training import curves as dvclive_files

#: Training stages and the model folder whose ``dvclive/`` (or ``metrics.jsonl``) holds their per-step logs.
TRAINING = [("sft", "sft"), ("rl", "rl"), ("distill", "student")]
#: Metrics drawn first when a stage logs them (TRL's names); the rest stay in the per-stage table.
PREFERRED = ["loss", "reward", "reward_std", "kl", "entropy", "grad_norm", "learning_rate", "teacher_loss",
             "student_loss", "completions/mean_length", "frac_reward_zero_std"]
MAX_CHART_METRICS = 6
#: Evaluation order of the learning table (others follow alphabetically).
POLICY_ORDER = ["oracle", "base", "sft", "rl", "student"]

CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:0;color:#1d232a;background:#f6f7f9}
main{max-width:1100px;margin:0 auto;padding:18px 24px 60px}
h1{font-size:22px;margin:8px 0 2px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #d8dde3;padding-bottom:4px}
h3{font-size:14px;margin:16px 0 6px}
.sub{color:#5b6672;margin-bottom:12px}
table{border-collapse:collapse;background:#fff;margin:6px 0 10px;font-variant-numeric:tabular-nums}
th,td{border:1px solid #d8dde3;padding:4px 8px;text-align:right;vertical-align:top}
th{background:#eef1f4;font-weight:600}td.l,th.l{text-align:left}
.ok{color:#17803d;font-weight:600}.bad{color:#b42318;font-weight:600}.muted{color:#6b7580}
.card{background:#fff;border:1px solid #d8dde3;border-radius:6px;padding:10px 14px;margin:8px 0}
.verdict{font-size:16px}.chart svg{max-width:100%;height:auto}
code{background:#eef1f4;padding:1px 4px;border-radius:3px;font-size:12.5px}
nav a{margin-right:12px}details summary{cursor:pointer;color:#35516e}
.grid{display:flex;flex-wrap:wrap;gap:10px}.grid>div{flex:1 1 480px}
"""


# ---- reading (every reader returns an empty value when its input is missing) -------------------

def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _jsonl(path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    try:
        text = Path(path).read_text()
    except OSError:
        return rows
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(float(v)) else None


def evaluations(paths: Paths) -> dict[str, dict[str, Any]]:
    """``{policy: metrics}`` on the benchmark: the base model's (``data/benchmark/eval``, scored once) and
    this iteration's (``data/iter_k/eval/*.json``), in the learning order."""
    files = [f for d in (paths.benchmark_eval_dir, paths.eval_dir) if d.is_dir() for f in eval_jsons(d)]
    found = {p.stem: _json(p) for p in files}
    order = [p for p in POLICY_ORDER if p in found] + sorted(p for p in found if p not in POLICY_ORDER)
    return {p: found[p] for p in order if found[p]}


def curves(paths: Paths) -> dict[str, list[dict[str, Any]]]:
    """Per training stage, its per-step rows (numeric fields only, ``step`` guaranteed)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for stage, folder in TRAINING:
        rows = []
        live = paths.models / folder / dvclive_files.DVCLIVE_DIR  # the DVCLive files DVC plots (else the JSONL log)
        logged = dvclive_files.read_dvclive(live) if live.is_dir() else _jsonl(paths.models / folder / "metrics.jsonl")
        for i, r in enumerate(logged):
            step = _num(r.get("step", r.get("global_step", i)))
            nums = {k: v for k, v in ((k, _num(v)) for k, v in r.items()) if v is not None and k != "global_step"}
            nums["step"] = step if step is not None else float(i)
            rows.append(nums)
        out[stage] = rows
    return out


def exclusions(paths: Paths, success_only: bool) -> dict[str, int] | None:
    """Teacher rows the gate left out of the SFT set, by reason (None without teacher data)."""
    if not paths.teacher_trajectories.exists():
        return None
    from apprentice.data.trajectories import read_parquet
    from apprentice.stages.validate import sft_rows

    try:
        teacher = read_parquet(paths.teacher_trajectories)
        _, excluded = sft_rows(teacher, success_only)
    except Exception:  # a malformed table: the gate section reports it from gate.json
        return None
    return {"teacher rows": len(teacher), **excluded}


def dvc_hashes(root: Path, iteration: int) -> list[tuple[str, str, str, str]]:
    """``(stage, kind, path, md5)`` for this iteration's DVC stages (and prepare-base) in ``dvc.lock``."""
    try:
        stages = (yaml.safe_load((root / "dvc.lock").read_text()) or {}).get("stages", {})
    except (OSError, yaml.YAMLError):
        return []
    rows = []
    for name, entry in stages.items():
        if not (name == "prepare-base" or name.endswith(f"-{iteration}")):
            continue
        for kind in ("outs", "deps"):
            for item in entry.get(kind, []) or []:
                path = str(item.get("path", ""))
                if kind == "deps" and ("apprentice/" in path or path.endswith("expectations")):
                    continue  # code: the git commit pins it
                rows.append((name, kind[:-1], path, str(item.get("md5") or item.get("hash") or "")))
    return rows


def trend(root: Path, upto: int) -> list[dict[str, Any]]:
    """Per iteration 1..upto: the champion after promotion, the challenger, and their success rates."""
    out = []
    for j in range(1, upto + 1):
        pj = Paths(root, j)
        promo = _json(pj.promotion)
        if not promo:
            continue
        cand = str(promo.get("candidate", ""))
        ev = _json(pj.eval_dir / f"{cand}.json")
        promoted = bool(promo.get("promoted"))
        champ_success = promo.get("challenger_success") if promoted else promo.get("champion_success")
        out.append({"iteration": j, "candidate": cand, "version": promo.get("version"), "promoted": promoted,
                    "champion_version": promo.get("champion_version"),
                    "challenger_success": _num(promo.get("challenger_success")),
                    "challenger_ci": (_num(ev.get("success_ci_low")), _num(ev.get("success_ci_high"))),
                    "champion_success": _num(champ_success), "p_value": _num(promo.get("p_value"))})
    return out


def _relative_store(ml: dict[str, Any], root: Path) -> dict[str, Any]:
    """A local store under the work dir named relative to it (``sqlite:///mlruns.db``), as the page's
    ``mlflow ui`` command runs from there; a server URL or a store elsewhere is shown as it is."""
    uri, here = str(ml.get("tracking_uri", "")), f"{Path(root).resolve()}/"
    for scheme in ("sqlite:///", "file://", ""):
        if uri.startswith(scheme + here):
            rest = uri[len(scheme + here):]
            ml["tracking_uri"] = f"sqlite:///{rest}" if scheme == "sqlite:///" else rest
            break
    return ml


def collect(paths: Paths, mlflow_runs: Mapping[str, Any] | None = None, git_commit: str | None = None) -> dict[str, Any]:
    """Everything the page shows, as plain data (tests and other renderers can use it)."""
    params: dict[str, Any] = {}
    with contextlib.suppress(OSError, yaml.YAMLError):
        params = yaml.safe_load((paths.root / "params.yaml").read_text()) or {}
    vcfg, pcfg = params.get("validate", {}) or {}, params.get("promote", {}) or {}
    return {
        "iteration": paths.iteration, "root": ".",  # the page is a DVC output: no clone-specific absolute path
        "profile": (params.get("pipeline", {}) or {}).get("profile", "default"),
        "generated": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "evaluations": evaluations(paths), "curves": curves(paths),
        "gate": _json(paths.gate_record),
        "exclusions": exclusions(paths, bool(vcfg.get("success_only", True))),
        "promotion": _json(paths.promotion), "alpha": pcfg.get("alpha"),
        "trend": trend(paths.root, paths.iteration), "dvc": dvc_hashes(paths.root, paths.iteration),
        "drift": _drift(paths), "levels": _levels(paths), "frontier": _decisions(paths),
        "mlflow": _relative_store(dict(mlflow_runs or {}), paths.root), "git_commit": git_commit or "unknown",
    }


# ---- rendering ----------------------------------------------------------------------------------

def _e(v: Any) -> str:
    return html.escape(str(v))


def _pct(v: Any) -> str:
    x = _num(v)
    return "–" if x is None else f"{100 * x:.1f}%"


def _ci(lo: Any, hi: Any) -> str:
    a, b = _num(lo), _num(hi)
    return "–" if a is None or b is None else f"[{100 * a:.1f}, {100 * b:.1f}]"


def _f(v: Any, fmt: str = ".2f") -> str:
    x = _num(v)
    return "–" if x is None else format(x, fmt)


def _table(head: Iterable[str] | None, rows: Iterable[Iterable[Any]], left: int = 1, cls: str = "") -> str:
    if head is None:  # a key/value table
        body = "".join(f'<tr><th class="l">{k}</th><td class="l">{v}</td></tr>' for k, v in rows)
        return f'<table class="{cls}"><tbody>{body}</tbody></table>'
    h = "".join(f'<th class="l">{_e(c)}</th>' if i < left else f"<th>{_e(c)}</th>" for i, c in enumerate(head))
    body = "".join("<tr>" + "".join(f'<td class="l">{c}</td>' if i < left else f"<td>{c}</td>"
                                    for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>'


def _svg(spec: dict[str, Any]) -> str:
    """A Vega-Lite chart as inline SVG (vl-convert bundles the engine: no network, no browser)."""
    try:
        import vl_convert as vlc

        svg = vlc.vegalite_to_svg(spec)
    except Exception as e:  # a chart must never cost the page
        return f'<p class="muted">(chart unavailable: {_e(e.__class__.__name__)}: {_e(str(e)[:200])})</p>'
    return f'<div class="chart">{svg}</div>'


def _missing(what: str, how: str) -> str:
    return f'<p class="muted">No {_e(what)} yet. {how}</p>'


def _learning(ev: dict[str, dict[str, Any]]) -> str:
    if not ev:
        return _missing("evaluation results", "Run <code>python -m apprentice evaluate-all</code> "
                        "(or the <code>evaluate-*</code> DVC stages).")
    ks = sorted({int(k.rsplit("_", 1)[1]) for m in ev.values() for k in m if k.startswith("pass_at_")})
    head = ["policy", "episodes", "success", "95% Wilson CI", *(f"pass@{k}" for k in ks), "mean turns",
            "mean tokens", "truncated", "tool errors", "parse errors"]
    rows = [[f"<b>{_e(p)}</b>", _e(m.get("n_episodes", "–")), _pct(m.get("success_rate")),
             _ci(m.get("success_ci_low"), m.get("success_ci_high")), *(_pct(m.get(f"pass_at_{k}")) for k in ks),
             _f(m.get("mean_turns")), _f(m.get("mean_tokens"), ".0f"), _pct(m.get("truncation_rate")),
             _pct(m.get("tool_error_rate")), _pct(m.get("parse_error_rate"))] for p, m in ev.items()]
    values = [{"policy": p, "success": m.get("success_rate"), "lo": m.get("success_ci_low"),
               "hi": m.get("success_ci_high")} for p, m in ev.items() if _num(m.get("success_rate")) is not None]
    chart = _svg({
        "$schema": "https://vega.github.io/schema/vega-lite/v5.json", "width": 420, "height": 26 * len(values) + 10,
        "title": "held-out success with 95% Wilson intervals", "data": {"values": values},
        "encoding": {"y": {"field": "policy", "type": "nominal", "sort": list(ev)}},
        "layer": [{"mark": {"type": "rule", "strokeWidth": 2},
                   "encoding": {"x": {"field": "lo", "type": "quantitative", "scale": {"domain": [0, 1]},
                                      "axis": {"format": "%"}, "title": "success"}, "x2": {"field": "hi"}}},
                  {"mark": {"type": "point", "filled": True, "size": 70},
                   "encoding": {"x": {"field": "success", "type": "quantitative"}}}]}) if values else ""
    return _table(head, rows) + chart


def _breakdown(ev: dict[str, dict[str, Any]]) -> str:
    groups = sorted({k.split("/")[0] for m in ev.values() for k in m if "/" in k},
                    key=lambda s: (not s.startswith("level_"), s))
    if not groups:
        return _missing("per-family or per-level results", "They come with the evaluation results.")
    out = []
    for prefix, title in (("level_", "per difficulty level"), ("family_", "per family")):
        gs = [g for g in groups if g.startswith(prefix)]
        if not gs:
            continue
        rows = []
        for g in gs:
            cells = [f"<b>{_e(g.split('_', 1)[1])}</b>"]
            for m in ev.values():
                if f"{g}/success_rate" not in m:
                    cells.append('<span class="muted">–</span>')
                    continue
                cells.append(f"{_pct(m[f'{g}/success_rate'])} <span class='muted'>"
                             f"{_ci(m.get(f'{g}/success_ci_low'), m.get(f'{g}/success_ci_high'))} "
                             f"n={_e(m.get(f'{g}/n', '?'))}</span>")
            rows.append(cells)
        out.append(f"<h3>{title}</h3>" + _table([prefix.rstrip("_"), *ev], rows))
    return "".join(out)


def _chart_metrics(rows: list[dict[str, Any]]) -> list[str]:
    present = {k for r in rows for k in r if k not in ("step", "time", "epoch")}
    varying = {k for k in present if len({r.get(k) for r in rows if k in r}) > 1 or len(rows) == 1}
    first = [k for k in PREFERRED if k in present and k in varying]
    rest = sorted(k for k in varying if k not in first)
    return (first + rest)[:MAX_CHART_METRICS]


def _curves(cv: dict[str, list[dict[str, Any]]]) -> str:
    out = []
    for stage, rows in cv.items():
        if not rows:
            out.append(f"<h3>{_e(stage)}</h3>" + _missing(f"{stage} training log",
                                                          f"Run the <code>{stage}</code> stage."))
            continue
        metrics = _chart_metrics(rows)
        values = [{"step": r["step"], "metric": k, "value": r[k]} for r in rows for k in metrics if k in r]
        chart = _svg({
            "$schema": "https://vega.github.io/schema/vega-lite/v5.json", "data": {"values": values},
            "facet": {"field": "metric", "type": "nominal", "title": None, "sort": metrics}, "columns": 3,
            "spec": {"width": 280, "height": 130, "mark": {"type": "line", "point": True},
                     "encoding": {"x": {"field": "step", "type": "quantitative"},
                                  "y": {"field": "value", "type": "quantitative", "scale": {"zero": False},
                                        "title": None}}},
            "resolve": {"scale": {"y": "independent"}}}) if values else ""
        last = {k: r[k] for r in rows for k in metrics if k in r}  # each metric's last logged value
        summary = ", ".join(f"{k} {_f(last[k], '.4g')}" for k in metrics if k in last)
        cols = ["step", *sorted({k for r in rows for k in r} - {"step"})]
        table = _table(cols, [[_f(r.get(c), ".4g") for c in cols] for r in rows], left=0)
        out.append(f"<h3>{_e(stage)} <span class='muted'>({len(rows)} logged steps; last: {summary})</span></h3>"
                   f"{chart}<details><summary>every logged value</summary>{table}</details>")
    return "".join(out)


def _gate(gate: dict[str, Any], excl: dict[str, int] | None) -> str:
    if not gate:
        return _missing("data-gate result", "Run <code>python -m apprentice validate</code>.")
    ok = bool(gate.get("passed"))
    head = (f'<p class="verdict">Data gate <span class="{"ok" if ok else "bad"}">{"PASSED" if ok else "FAILED"}'
            f'</span>: {_e(gate.get("expectations", "?"))} expectations, {_e(gate.get("failed", 0))} failed '
            f'(full report: <a href="gate.html">gate.html</a>).</p>')
    rows, failed = [], []
    for key, suite in (gate.get("suites") or {}).items():
        checks = suite.get("checks", [])
        bad = [c for c in checks if not c.get("success")]
        rows.append([_e(suite.get("table", key)), _e(suite.get("suite", "")), _e(suite.get("rows", "")),
                     f"{len(checks) - len(bad)}/{len(checks)}",
                     '<span class="ok">pass</span>' if not bad else '<span class="bad">FAIL</span>'])
        for c in bad:
            failed.append([_e(suite.get("table", key)), f"<code>{_e(c.get('expectation'))}</code>",
                           _e(json.dumps(c.get("kwargs", {}), default=str)[:200]),
                           _e(c.get("unexpected_count") or ""),
                           _e(json.dumps(c.get("examples") or c.get("observed"), default=str)[:240])])
    out = head + _table(["table", "suite", "rows", "expectations met", "result"], rows)
    if failed:
        out += "<h3>failed expectations</h3>" + _table(["table", "expectation", "arguments", "bad rows",
                                                         "examples / observed"], failed, left=3)
    if excl:
        n = excl.get("teacher rows", 0)
        kept = n - sum(v for k, v in excl.items() if k != "teacher rows")
        rows = [[_e(k), _e(v), _pct(v / n if n else None)] for k, v in excl.items() if k != "teacher rows"]
        out += (f"<h3>excluded from the SFT set</h3><p>{kept} of {n} teacher episodes kept for SFT; "
                "each excluded row counted under its first reason:</p>" + _table(["reason", "rows", "share"], rows))
    return out


def _promotion(promo: dict[str, Any], alpha: Any) -> str:
    if not promo:
        return _missing("promotion decision", "Run <code>python -m apprentice promote</code>.")
    won = bool(promo.get("promoted"))
    verdict = ('<span class="ok">promoted to champion</span>' if won
               else '<span class="bad">kept as challenger</span>; the champion stays')
    card = (f'<div class="card"><p class="verdict"><b>{_e(promo.get("registered_model"))} '
            f'v{_e(promo.get("version"))}</b> ({_e(promo.get("candidate"))}): {verdict}.</p>'
            f'<p>{_e(promo.get("reason", ""))}</p></div>')
    rows = [["test", "exact McNemar on the same held-out episodes (paired by problem and sample)"
             if _num(promo.get("p_value")) is not None else "none (no earlier champion to compare with)"],
            ["significance level (promote.alpha)", _e(alpha if alpha is not None else "?")],
            ["p-value", _f(promo.get("p_value"), ".4g")],
            ["pairs", _e(promo.get("n_pairs", "–"))],
            ["solved only by the challenger", _e(promo.get("challenger_only", "–"))],
            ["solved only by the champion", _e(promo.get("champion_only", "–"))],
            ["challenger success", _pct(promo.get("challenger_success"))],
            ["champion success (same problems)", _pct(promo.get("champion_success"))],
            ["champion before → after", f"v{_e(promo.get('champion_before') or '–')} → "
                                        f"v{_e(promo.get('champion_version'))}"],
            ["weights (DVC)", f"<code>{_e(promo.get('weights_path', ''))}</code> md5 "
                              f"<code>{_e(promo.get('dvc_md5', ''))}</code>"]]
    tested = promo.get("tested") or {}
    if len(tested) > 1:  # every model of the iteration tested against the champion, each at alpha / m
        rows.insert(2, [f"models tested (each at alpha / {len(tested)})", ", ".join(
            f"{_e(k)}: {_pct(t.get('challenger_success'))}, {_e(t.get('challenger_only', '–'))} / "
            f"{_e(t.get('champion_only', '–'))}, p = {_f(t.get('p_value'), '.4g')}" for k, t in tested.items())])
    return card + _table(None, rows)


def _trend(tr: list[dict[str, Any]]) -> str:
    if not tr:
        return _missing("promotion history", "Each iteration's promote stage adds a point.")
    rows = [[f"iteration {t['iteration']}", _e(t["candidate"]), f"v{_e(t['version'])}",
             '<span class="ok">promoted</span>' if t["promoted"] else "kept",
             f"v{_e(t['champion_version'])}", _pct(t["champion_success"]), _pct(t["challenger_success"]),
             _ci(*t["challenger_ci"]), _f(t["p_value"], ".3g")] for t in tr]
    table = _table(["iteration", "candidate", "version", "decision", "champion after", "champion success",
                    "challenger success", "challenger 95% CI", "p-value"], rows)
    values = []
    for t in tr:
        lo, hi = t["challenger_ci"]
        values.append({"iteration": t["iteration"], "who": "challenger", "success": t["challenger_success"],
                       "lo": lo, "hi": hi})
        if t["champion_success"] is not None:
            values.append({"iteration": t["iteration"], "who": "champion", "success": t["champion_success"]})
    x = {"field": "iteration", "type": "ordinal"}
    chart = _svg({
        "$schema": "https://vega.github.io/schema/vega-lite/v5.json", "width": 420, "height": 180,
        "title": "champion across iterations", "data": {"values": values},
        "layer": [{"transform": [{"filter": "datum.who == 'challenger'"}], "mark": {"type": "rule"},
                   "encoding": {"x": x, "y": {"field": "lo", "type": "quantitative", "title": "held-out success"},
                                "y2": {"field": "hi"}}},
                  {"mark": {"type": "line", "point": True},
                   "encoding": {"x": x, "y": {"field": "success", "type": "quantitative", "scale": {"domain": [0, 1]},
                                              "axis": {"format": "%"}, "title": "held-out success"},
                                "color": {"field": "who", "type": "nominal"}}}]})
    return table + chart


def _drift(paths: Paths) -> list[dict[str, Any]]:
    from apprentice.stages.report import drift_history

    try:
        return drift_history(paths)
    except Exception:  # a malformed evaluation table: the learning table reports it
        return []


def _levels(paths: Paths) -> list[dict[str, Any]]:
    from apprentice.stages.report import level_history

    try:
        return level_history(paths)
    except Exception:  # a malformed evaluation table: the learning table reports it
        return []


def _decisions(paths: Paths) -> list[dict[str, Any]]:
    from apprentice.stages.report import frontier_history

    try:
        return frontier_history(paths)
    except (OSError, ValueError):
        return []


def _drift_section(history: list[dict[str, Any]]) -> str:
    """Drift guards: the champion per iteration, per family, and its action diversity (iterated
    self-improvement can collapse or drift over rounds while the headline success rate holds)."""
    if not any("success_rate" in r for r in history):
        return _missing("champion evaluations", "Each iteration's promote stage names a champion; its benchmark "
                        "episodes give the per-family success and action diversity.")
    from apprentice.stages.report import champion_chart

    fams = sorted({k for r in history for k in r if k.startswith("family_")})
    head = ["iteration", "champion", "success", "95% Wilson CI", *(f.split("/")[0].removeprefix("family_") for f in fams),
            "action entropy (nats)", "distinct actions"]
    rows = [[f"iteration {r['iteration']}", _e(r["champion"]), _pct(r.get("success_rate")),
             _ci(r.get("success_ci_low"), r.get("success_ci_high")), *(_pct(r.get(f)) for f in fams),
             _f(r.get("action_entropy"), ".3f"), _pct(r.get("distinct_action_ratio"))] for r in history]
    note = ('<p class="muted">Falling action entropy or distinct-action share on the same benchmark, or a family '
            "whose success falls while the total holds, is the collapse / recursive-drift warning.</p>")
    return _table(head, rows) + note + _svg(champion_chart(history))


def _heat(v: float | None) -> str:
    """A cell's background: white at 0, green at 1 (readable without a legend, printable)."""
    if v is None:
        return ""
    return f' style="background:rgb({int(255 - 145 * v)},{int(255 - 55 * v)},{int(255 - 135 * v)})"'


def _frontier_section(levels: list[dict[str, Any]], decisions: list[dict[str, Any]]) -> str:
    """The champion's benchmark success per family x level across iterations (a heatmap), and what the
    frontier controller decided each iteration (window, ceiling, the synthesis mix)."""
    if not levels:
        return _missing("champion evaluations per level", "Each promotion names a champion; its benchmark episodes "
                        "give the success per family and level.")
    its = sorted({r["iteration"] for r in levels})
    cells = {(r["family"], r["level"], r["iteration"]): r for r in levels}
    rows = []
    for fam, lv in sorted({(r["family"], r["level"]) for r in levels}):
        tds = []
        for j in its:
            r = cells.get((fam, lv, j))
            tds.append(f'<td{_heat(r["success"] if r else None)}>'
                       + (f'{r["successes"]}/{r["n"]}' if r else "") + "</td>")
        rows.append(f"<tr><td>{_e(fam)}</td><td>{lv}</td>{''.join(tds)}</tr>")
    head = "".join(f"<th>champion after iteration {j}</th>" for j in its)
    heat = f"<table><tr><th>family</th><th>level</th>{head}</tr>{''.join(rows)}</table>"
    if not decisions:
        return heat
    drows = [[f"iteration {d['iteration']}", _e(d["family"]),
              "-" if not d.get("window") else f"{d['window'][0]}-{d['window'][1]}", _e(d.get("ceiling")),
              _e(", ".join(f"L{k}: {v}" for k, v in sorted(d.get("mix", {}).items(), key=lambda kv: int(kv[0])))),
              "yes" if d.get("past_range") else ""] for d in decisions]
    return (heat + "<h3>What the frontier controller decided</h3>"
            + _table(["iteration", "family", "window", "ceiling", "synthesis mix (level: problems)", "past range"],
                     drows, left=5))


def _lineage(data: dict[str, Any]) -> str:
    ml = data["mlflow"]
    out = [f"<p>git commit <code>{_e(data['git_commit'])}</code>; work dir: the folder holding this run's "
           "<code>dvc.yaml</code> (paths below are relative to it)</p>"]
    if ml.get("stages"):
        uri = ml.get("tracking_uri", "")
        ui = ml.get("ui_url", "http://127.0.0.1:5000").rstrip("/")
        exp = ml.get("experiment_id", "")
        link = lambda rid: f'<a href="{_e(ui)}/#/experiments/{_e(exp)}/runs/{_e(rid)}"><code>{_e(rid)}</code></a>'  # noqa: E731
        rows = [[f"<b>{_e(ml['parent']['name'])}</b> (iteration)", link(ml["parent"]["run_id"])]]
        rows += [[_e(name), link(rid)] for name, rid in ml["stages"].items()]
        out.append(f"<p>MLflow store <code>{_e(uri)}</code>, experiment id {_e(exp)}; links open "
                   f"<code>mlflow ui --backend-store-uri {_e(uri)}</code> on {_e(ui)}.</p>")
        out.append(_table(["MLflow run", "run id"], rows, left=2))
    else:
        out.append('<p class="muted">No MLflow run ids: this report was built outside the Prefect flow '
                   "(plain <code>dvc repro</code> or the CLI). <code>make run</code> records them.</p>")
    if data["dvc"]:
        def lock_rows(kind: str) -> list[list[str]]:
            return [[_e(s), f"<code>{_e(p)}</code>", f"<code>{_e(m)}</code>"] for s, k, p, m in data["dvc"] if k == kind]

        out.append("<h3>DVC hashes (dvc.lock): what each stage produced</h3>"
                   + _table(["stage", "output", "md5"], lock_rows("out"), left=3)
                   + "<details><summary>and what each stage read</summary>"
                   + _table(["stage", "input", "md5"], lock_rows("dep"), left=3) + "</details>")
    else:
        out.append(_missing("dvc.lock entries", "Stages run through <code>dvc repro</code> record them."))
    return "".join(out)


def render(data: dict[str, Any]) -> str:
    k = data["iteration"]
    sections = [("learning", "Learning table", _learning(data["evaluations"])),
                ("breakdown", "Per level and per family", _breakdown(data["evaluations"])),
                ("curves", "Learning curves", _curves(data["curves"])),
                ("gate", "Data gate", _gate(data["gate"], data["exclusions"])),
                ("promotion", "Promotion", _promotion(data["promotion"], data["alpha"])),
                ("trend", "Champion across iterations", _trend(data["trend"])),
                ("frontier", "Frontier: the champion per level", _frontier_section(data.get("levels", []),
                                                                                    data.get("frontier", []))),
                ("drift", "Drift guards", _drift_section(data.get("drift", []))),
                ("lineage", "Lineage", _lineage(data))]
    nav = "".join(f'<a href="#{i}">{_e(t)}</a>' for i, t, _ in sections)
    body = "".join(f'<section id="{i}"><h2>{_e(t)}</h2>{s}</section>' for i, t, s in sections)
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width,initial-scale=1">'
            f"<title>Apprentice iteration {k}</title><style>{CSS}</style></head><body><main>"
            f"<h1>Apprentice: iteration {k}</h1>"
            f'<div class="sub">profile <b>{_e(data["profile"])}</b> · generated {_e(data["generated"])} · '
            f'commit <code>{_e(str(data["git_commit"])[:12])}</code></div><nav>{nav}</nav>{body}'
            "</main></body></html>\n")


def write(paths: Paths, mlflow_runs: Mapping[str, Any] | None = None, git_commit: str | None = None) -> Path:
    """Render ``reports/iter_k/index.html`` atomically; returns its path."""
    out = paths.report_page
    page = render(collect(paths, mlflow_runs, git_commit))
    with atomic_path(out) as tmp:
        tmp.write_text(page)
    return out
