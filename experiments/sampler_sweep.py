"""Compare the curriculum samplers by *trained* outcome with a ``dvc exp`` sweep.

    .venv/bin/python experiments/sampler_sweep.py --profile quick --workdir /tmp/sweep-quick
    .venv/bin/python experiments/sampler_sweep.py --profile default --workdir /tmp/sweep-default

What it does, all through DVC (nothing here trains or evaluates by itself):
  1. clones the repository's HEAD into ``--workdir`` (the sweep never touches your checkout: ``dvc exp``
     rewrites ``params.yaml`` in the workspace it runs in), links ``.venv``, copies an existing
     ``models/base`` and records it with ``dvc commit`` (so prepare-base is not rebuilt), generates
     the profile's pipeline (``runs/<profile>`` for non-default profiles) and commits it there;
  2. ``dvc exp run -n baseline -S rl.curriculum=difficulty evaluate-1@sft evaluate-1@rl`` (the iteration
     up to RL and the evaluations of SFT and RL), then one ``dvc exp run -n sampler-<s> -S
     rl.curriculum=sampler -S curriculum.sampler=<s> evaluate-1@sft evaluate-1@rl`` per sampler. DVC
     reruns only ``rl-1`` and ``evaluate-1@rl`` (synth, rollout, validate, SFT and the SFT evaluation
     stay cached; distillation is not a target). ``--full`` runs the whole iteration per experiment
     instead (adds distillation, the student's evaluation, promotion and the report: ~2x the time);
  3. reads ``dvc exp show --json`` and prints / writes a Markdown table of each experiment's held-out
     success (RL model and student, with 95 % Wilson intervals) and, with ``--figure``, a PNG.

Why a script and not only the README's one-liner: the clone keeps ``dvc exp`` away from a working
tree with uncommitted changes, and reading ``dvc exp show --json`` into a table is the part people
get wrong by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLERS = ("pass_band", "dtac", "hdc", "aes")


def sh(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    print("$", " ".join(args), f"(in {cwd})", flush=True)
    proc = subprocess.run(args, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if proc.returncode:
        print(proc.stdout[-6000:])
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(args)}")
    return proc.stdout


def prepare(work: Path, profile: str, env: dict[str, str]) -> Path:
    """A throwaway clone of HEAD with the profile's pipeline committed; returns the pipeline dir."""
    if work.exists():
        shutil.rmtree(work)
    sh(["git", "clone", "-q", str(REPO), str(work)], REPO, env)
    (work / ".venv").symlink_to(REPO / ".venv")
    git = ["git", "-c", "user.name=sweep", "-c", "user.email=sweep@localhost"]
    sh([sys.executable, "-m", "apprentice.ops.dvcgen", "--profile", profile], work, env)
    pipe = work if profile == "default" else work / "runs" / profile
    if profile == "default" and (REPO / "models" / "base" / "config.json").exists():
        shutil.copytree(REPO / "models" / "base", work / "models" / "base")
        sh([sys.executable, "-m", "dvc", "commit", "-f", "-q", "prepare-base"], work, env)
    sh(["git", "add", "-A"], work, env)
    sh([*git, "commit", "-q", "-m", f"sampler sweep on {profile}"], work, env)
    return pipe


#: What each experiment reproduces unless ``--full``: RL and the evaluations the comparison reads.
TARGETS = ["evaluate-1@sft", "evaluate-1@rl"]


def run_experiments(pipe: Path, samplers: list[str], env: dict[str, str], targets: list[str]) -> None:
    dvc = [sys.executable, "-m", "dvc", "exp", "run"]
    runs = [("baseline", ["-S", "rl.curriculum=difficulty"])]
    runs += [(f"sampler-{s}", ["-S", "rl.curriculum=sampler", "-S", f"curriculum.sampler={s}"]) for s in samplers]
    for name, overrides in runs:
        out = sh([*dvc, "-n", name, *overrides, *targets], pipe, env)
        ran = [line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage")]
        print(f"  {name}: ran {', '.join(ran) or 'nothing'}", flush=True)


def collect(pipe: Path, env: dict[str, str], prefix: str) -> list[dict]:
    """One row per experiment from ``dvc exp show --json``: name, sampler, held-out success per model.

    ``prefix`` is the pipeline's path in the repo (``runs/quick/``; empty for default): DVC reports the
    params and metrics of every pipeline in the repo, keyed by repo-relative path."""
    out = sh([sys.executable, "-m", "dvc", "exp", "show", "--json"], pipe, env)
    data = json.loads(out[out.index("["):])
    rows = []
    for commit in data:
        for exp in commit.get("experiments") or []:
            for rev in exp.get("revs") or []:
                d = rev.get("data") or {}
                params = (d.get("params") or {}).get(f"{prefix}params.yaml", {}).get("data", {})
                row = {"experiment": rev.get("name") or exp.get("name"), "rev": rev.get("rev"),
                       "curriculum": params.get("rl", {}).get("curriculum"),
                       "sampler": params.get("curriculum", {}).get("sampler")}
                for path, m in (d.get("metrics") or {}).items():
                    name = Path(path).stem
                    if path.startswith(f"{prefix}data/") and "/eval/" in path and name in ("rl", "sft", "student"):
                        md = m.get("data", {})
                        row[name] = (md.get("success_rate"), md.get("success_ci_low"), md.get("success_ci_high"))
                rows.append(row)
    rows = sorted(rows, key=lambda r: (r["experiment"] != "baseline", r["experiment"] or ""))
    paired_vs_baseline(rows, pipe, prefix)
    return rows


def paired_vs_baseline(rows: list[dict], pipe: Path, prefix: str) -> None:
    """McNemar of each experiment's RL model against the baseline's, on the same held-out episodes.

    The per-episode tables are DVC outputs of each experiment commit, read through ``dvc.api``: the
    intervals of two 40-problem evaluations overlap for any plausible difference, the paired test on
    the discordant problems is the sharper question."""
    import io

    import dvc.api
    import pandas as pd

    from apprentice.evaluation.metrics import paired_test

    def table_of(rev: str) -> pd.DataFrame | None:
        repo = pipe.parents[1] if prefix else pipe  # runs/<profile>/ lives two levels below the repo
        try:
            raw = dvc.api.read(f"{prefix}data/iter_1/eval/rl.parquet", repo=str(repo), rev=rev, mode="rb")
        except Exception as e:  # an experiment that failed before evaluating RL
            print(f"(no RL episodes at {rev}: {e.__class__.__name__})")
            return None
        return pd.read_parquet(io.BytesIO(raw))

    base = next((r for r in rows if r["experiment"] == "baseline" and r.get("rev")), None)
    ref = table_of(base["rev"]) if base else None
    for r in rows:
        if ref is None or r is base or not r.get("rev"):
            continue
        df = table_of(r["rev"])
        if df is not None:
            t = paired_test(df, ref)
            r["vs_baseline"] = (t["a_only"], t["b_only"], t["p_value"])


def table(rows: list[dict], profile: str) -> str:
    def cell(v: tuple | None) -> str:
        return "n/a" if not v or v[0] is None else f"{v[0]:.0%} [{v[1]:.0%}, {v[2]:.0%}]"

    def paired(r: dict) -> str:
        v = r.get("vs_baseline")
        return "-" if not v else f"{v[0]} / {v[1]}, p = {v[2]:.2g}"

    student = any(r.get("student") and r["student"][0] is not None for r in rows)
    lines = [f"| experiment ({profile}) | RL order | sampler | SFT success | RL success | RL vs baseline: "
             f"only this / only baseline, McNemar |{' student success |' if student else ''}",
             f"|---|---|---|---|---|---|{'---|' if student else ''}"]
    for r in rows:
        sampler = r["sampler"] if r["curriculum"] == "sampler" else "-"
        extra = f" {cell(r.get('student'))} |" if student else ""
        lines.append(f"| {r['experiment']} | {r['curriculum']} | {sampler} | {cell(r.get('sft'))} | "
                     f"{cell(r.get('rl'))} | {paired(r)} |{extra}")
    return "\n".join(lines)


def figure(rows: list[dict], path: Path, profile: str) -> None:
    """Grouped bars with 95 % intervals, Vega-Lite rendered offline by vl-convert (the project's one plotting stack)."""
    import vl_convert as vlc

    models = ["sft", "rl"] + (["student"] if any(r.get("student") and r["student"][0] is not None for r in rows) else [])
    values = [{"experiment": r["experiment"], "model": m, "success": r[m][0], "low": r[m][1], "high": r[m][2]}
              for r in rows for m in models if r.get(m) and r[m][0] is not None]
    x = {"field": "experiment", "type": "nominal", "sort": [r["experiment"] for r in rows], "axis": {"labelAngle": -15}}
    spec = {"$schema": "https://vega.github.io/schema/vega-lite/v5.json", "width": 560, "height": 240,
            "title": f"curriculum samplers, {profile} profile (dvc exp)", "data": {"values": values},
            "encoding": {"x": x, "xOffset": {"field": "model", "sort": models},
                         "color": {"field": "model", "type": "nominal", "sort": models}},
            "layer": [{"mark": "bar", "encoding": {"y": {"field": "success", "type": "quantitative",
                                                         "title": "held-out success (95 % CI)",
                                                         "scale": {"domain": [0, 1]}}}},
                      {"mark": "rule", "encoding": {"y": {"field": "low", "type": "quantitative"}, "y2": {"field": "high"},
                                                    "color": {"value": "black"}}}]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(vlc.vegalite_to_png(spec, scale=1.5))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="quick")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/apprentice-sampler-sweep"))
    p.add_argument("--samplers", nargs="+", default=list(SAMPLERS), choices=SAMPLERS)
    p.add_argument("--figure", type=Path, help="write a PNG of the comparison here")
    p.add_argument("--markdown", type=Path, help="write the Markdown table here")
    p.add_argument("--collect-only", action="store_true", help="read the experiments of an earlier sweep")
    p.add_argument("--full", action="store_true", help="run the whole iteration per experiment (adds the student)")
    args = p.parse_args(argv)
    env = dict(os.environ, DVC_NO_ANALYTICS="1", DO_NOT_TRACK="true", MLFLOW_DISABLE_TELEMETRY="true",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = str(args.workdir)  # stages import the clone's code, not the checkout's editable install
    pipe = args.workdir if args.profile == "default" else args.workdir / "runs" / args.profile
    if not args.collect_only:
        pipe = prepare(args.workdir, args.profile, env)
        run_experiments(pipe, args.samplers, env, [] if args.full else TARGETS)
    rows = collect(pipe, env, "" if args.profile == "default" else f"runs/{args.profile}/")
    md = table(rows, args.profile)
    print(md)
    print(json.dumps(rows, indent=1))
    if args.markdown:
        args.markdown.write_text(md + "\n")
    if args.figure:
        figure(rows, args.figure, args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
