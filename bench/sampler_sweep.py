"""Issue B.6: compare the curriculum samplers by *trained* outcome with a ``dvc exp`` sweep.

    .venv/bin/python bench/sampler_sweep.py --profile quick --workdir /tmp/sweep-quick
    .venv/bin/python bench/sampler_sweep.py --profile default --workdir /tmp/sweep-default

What it does, all through DVC (nothing here trains or evaluates by itself):
  1. clones the repository's HEAD into ``--workdir`` (the sweep never touches your checkout: ``dvc exp``
     rewrites ``params.yaml`` in the workspace it runs in), links ``.venv``, copies an existing
     ``models/base`` and records it with ``dvc commit`` (so prepare-base is not rebuilt), generates
     the profile's pipeline (``runs/<profile>`` for non-default profiles) and commits it there;
  2. ``dvc exp run -n baseline -S rl.curriculum=difficulty`` (the whole iteration once), then one
     ``dvc exp run -n sampler-<s> -S rl.curriculum=sampler -S curriculum.sampler=<s>`` per sampler. DVC
     reruns only ``rl`` and what follows it (synth, rollout, validate and SFT stay cached);
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
    sh([sys.executable, "-m", "apprentice.dvcgen", "--profile", profile], work, env)
    pipe = work if profile == "default" else work / "runs" / profile
    if profile == "default" and (REPO / "models" / "base" / "config.json").exists():
        shutil.copytree(REPO / "models" / "base", work / "models" / "base")
        sh([sys.executable, "-m", "dvc", "commit", "-f", "-q", "prepare-base"], work, env)
    sh(["git", "add", "-A"], work, env)
    sh([*git, "commit", "-q", "-m", f"sampler sweep on {profile}"], work, env)
    return pipe


def run_experiments(pipe: Path, samplers: list[str], env: dict[str, str]) -> None:
    dvc = [sys.executable, "-m", "dvc", "exp", "run"]
    sh([*dvc, "-n", "baseline", "-S", "rl.curriculum=difficulty"], pipe, env)
    for s in samplers:
        sh([*dvc, "-n", f"sampler-{s}", "-S", "rl.curriculum=sampler", "-S", f"curriculum.sampler={s}"], pipe, env)


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
                row = {"experiment": rev.get("name") or exp.get("name"),
                       "curriculum": params.get("rl", {}).get("curriculum"),
                       "sampler": params.get("curriculum", {}).get("sampler")}
                for path, m in (d.get("metrics") or {}).items():
                    name = Path(path).stem
                    if path.startswith(f"{prefix}data/") and "/eval/" in path and name in ("rl", "sft", "student"):
                        md = m.get("data", {})
                        row[name] = (md.get("success_rate"), md.get("success_ci_low"), md.get("success_ci_high"))
                rows.append(row)
    return sorted(rows, key=lambda r: (r["experiment"] != "baseline", r["experiment"] or ""))


def table(rows: list[dict], profile: str) -> str:
    def cell(v: tuple | None) -> str:
        return "n/a" if not v or v[0] is None else f"{v[0]:.0%} [{v[1]:.0%}, {v[2]:.0%}]"

    lines = [f"| experiment ({profile}) | RL order | sampler | SFT success | RL success | student success |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        sampler = r["sampler"] if r["curriculum"] == "sampler" else "-"
        lines.append(f"| {r['experiment']} | {r['curriculum']} | {sampler} | {cell(r.get('sft'))} | "
                     f"{cell(r.get('rl'))} | {cell(r.get('student'))} |")
    return "\n".join(lines)


def figure(rows: list[dict], path: Path, profile: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["experiment"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for j, (model, color) in enumerate((("rl", "tab:blue"), ("student", "tab:orange"))):
        for i, r in enumerate(rows):
            v = r.get(model)
            if not v or v[0] is None:
                continue
            x = i + (j - 0.5) * 0.3
            ax.bar(x, v[0], width=0.3, color=color, label=model if i == 0 else None)
            ax.errorbar(x, v[0], yerr=[[v[0] - v[1]], [v[2] - v[0]]], color="k", capsize=3)
    ax.set_xticks(range(len(names)), names, rotation=15)
    ax.set_ylabel("held-out success (95 % CI)")
    ax.set_ylim(0, 1)
    ax.set_title(f"curriculum samplers, {profile} profile (dvc exp)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="quick")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/apprentice-sampler-sweep"))
    p.add_argument("--samplers", nargs="+", default=list(SAMPLERS), choices=SAMPLERS)
    p.add_argument("--figure", type=Path, help="write a PNG of the comparison here")
    p.add_argument("--markdown", type=Path, help="write the Markdown table here")
    p.add_argument("--collect-only", action="store_true", help="read the experiments of an earlier sweep")
    args = p.parse_args(argv)
    env = dict(os.environ, DVC_NO_ANALYTICS="1", DO_NOT_TRACK="true", MLFLOW_DISABLE_TELEMETRY="true",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = str(args.workdir)  # stages import the clone's code, not the checkout's editable install
    pipe = args.workdir if args.profile == "default" else args.workdir / "runs" / args.profile
    if not args.collect_only:
        pipe = prepare(args.workdir, args.profile, env)
        run_experiments(pipe, args.samplers, env)
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
