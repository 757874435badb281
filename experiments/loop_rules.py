"""Compare the loop rules (``loop.rule``), or the values of any one param, by the champion they leave,
one ``dvc exp run`` each.

    .venv/bin/python experiments/loop_rules.py --profile default --workdir /tmp/loop-rules --iterations 2
    .venv/bin/python experiments/loop_rules.py --profile quick   --workdir /tmp/loop-rules-quick
    .venv/bin/python experiments/loop_rules.py --pipe /tmp/run    # a finished `make run` clone: iteration 1 reused
    # the frontier controller against fixed levels, on a finished `make run PROFILE=long` (runs/long):
    .venv/bin/python experiments/loop_rules.py --pipe runs/long --iterations 4 --param frontier.mode --values frontier fixed

What it does, all through DVC (nothing here trains or evaluates by itself):
  1. a throwaway clone of HEAD (``experiments/sampler_sweep.py::prepare``: ``dvc exp`` rewrites params.yaml
     in its workspace); ``--iterations`` K must not exceed the profile's ``pipeline.iterations`` (the
     generated dvc.yaml declares that many; default 2);
  2. per rule, the MLflow registry rewound to what iteration 1 left (``lineage.rewind``: the rules
     share one workspace and so one registry; without it promote-2 of the second rule would meet
     the first rule's champion), then ``dvc exp run -n loop-<rule> -S loop.rule=<rule> report-<K>``
     (``--param``/``--values``: ``-S <param>=<value>`` instead):
     the same seeds everywhere (pipeline/synth/benchmark/rollout/SFT/RL seeds untouched), so
     iteration 1 is identical and cached after the first rule; every later iteration reruns from
     loop-data on;
  3. per rule and iteration, from the files the experiment leaves in the workspace: the
     champion after promote-k, its benchmark success with the 95 % Wilson interval, the exact McNemar
     test against the champion after promote-(k-1) on the same benchmark episodes, per-family
     success, and the wall time of the experiment; printed and written as the Markdown table of
     docs/experiments.md (``--table``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sampler_sweep import prepare, sh  # noqa: E402

RULES = ("continue", "restart", "self", "repair")


def champion_rows(pipe: Path, iterations: int) -> list[dict]:
    """Per iteration: the champion promote-k left, read from the workspace right after the experiment
    (``dvc exp run`` leaves its outputs there; promotion records are uncached metrics, git-ignored in
    the default profile, so neither the experiment's commit nor its DVC cache holds them)."""
    import pandas as pd

    from apprentice.evaluation.metrics import paired_test, summarize

    rows, prev = [], None
    for k in range(1, iterations + 1):
        promo = json.loads((pipe / f"reports/iter_{k}/promotion.json").read_text())
        c = promo["champion"]
        path = "data/benchmark/eval/base.parquet" if c.get("kind") == "base" else \
            f"data/iter_{c['iteration']}/eval/{c['kind']}.parquet"
        eps = pd.read_parquet(pipe / path)
        m = summarize(eps)
        row = {"iteration": k, "champion": "base" if c.get("kind") == "base" else
               f"v{c['version']} iter {c['iteration']} {c['kind']}", "success": m["success_rate"],
               "lo": m["success_ci_low"], "hi": m["success_ci_high"],
               "families": {key.split("/")[0].removeprefix("family_"): v for key, v in m.items()
                            if key.startswith("family_") and key.endswith("/success_rate")}}
        if prev is not None:
            t = paired_test(eps, prev)
            row["mcnemar"] = f"{t['a_only']} / {t['b_only']}, p = {t['p_value']:.3g}"
            # what the rule trained this iteration, kept or not, against the champion it had to beat
            row["models"] = []
            for kind in ("sft", "rl", "student"):
                table = pipe / f"data/iter_{k}/eval/{kind}.parquet"
                if table.is_file():
                    mine = pd.read_parquet(table)
                    t = paired_test(mine, prev)
                    row["models"].append(f"{kind.upper() if kind != 'student' else 'student'}-{k} "
                                         f"{100 * mine['success'].mean():.1f}% ({t['a_only']} / {t['b_only']}, "
                                         f"p = {t['p_value']:.2g})")
        rows.append(row)
        prev = eps
    return rows


def rewind_registry(pipe: Path, keep: int) -> list[str]:
    """The registry as iteration ``keep`` left it (its promotion record names the champion); no-op before it ran."""
    from apprentice.config import load_config
    from apprentice.ops import lineage

    record = pipe / "reports" / f"iter_{keep}" / "promotion.json"
    if not record.is_file():
        return []
    cfg = load_config(pipe / "params.yaml")
    lineage.configure(cfg.lineage.tracking_uri, cfg.lineage.experiment, pipe)
    champion = json.loads(record.read_text()).get("champion_version") or None
    return lineage.rewind(cfg.promote.registered_model, keep, champion)


def table(results: dict[str, tuple[list[dict], float]]) -> str:
    lines = ["| rule | iteration | champion | success [95 % CI] | vs previous champion: only new / only old, "
             "McNemar | per family | this iteration's models vs previous champion | wall time |",
             "|---|---|---|---|---|---|---|---|"]
    for rule, (rows, wall) in results.items():
        for r in rows:
            fam = ", ".join(f"{f} {100 * v:.0f}%" for f, v in sorted(r["families"].items()))
            lines.append(f"| {rule} | {r['iteration']} | {r['champion']} | {100 * r['success']:.1f}% "
                         f"[{100 * r['lo']:.0f}, {100 * r['hi']:.0f}] | {r.get('mcnemar', '-')} | {fam} | "
                         f"{'; '.join(r.get('models', [])) or '-'} | "
                         f"{wall / 60:.1f} min |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="default")
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--workdir", type=Path, help="a throwaway clone of HEAD is made here (deleted first)")
    where.add_argument("--pipe", type=Path, help="an existing pipeline dir (git repo, committed dvc.lock) whose "
                                                 "iteration 1 ran: reused, its registry rewound per rule")
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES)
    ap.add_argument("--param", default="loop.rule", help="the param the runs differ in (default: the loop rule)")
    ap.add_argument("--values", nargs="+", help="its values (default: --rules)")
    ap.add_argument("--table", type=Path, help="also write the Markdown table here")
    a = ap.parse_args()
    env = {**os.environ, "APPRENTICE_QUIET": "1", "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # dvc runs `python -m apprentice`
    pipe = a.pipe.resolve() if a.pipe else prepare(a.workdir, a.profile, env)
    results: dict[str, tuple[list[dict], float]] = {}
    values = a.values or a.rules
    for rule in values:
        name = f"loop-{rule}" if a.param == "loop.rule" else f"{a.param.rsplit('.', 1)[-1]}-{rule}"
        t0 = time.time()
        if gone := rewind_registry(pipe, 1):
            print(f"registry rewound to iteration 1: versions {', '.join(gone)} deleted", flush=True)
        subprocess.run([sys.executable, "-m", "dvc", "exp", "remove", name], cwd=pipe, env=env,
                       capture_output=True)  # a rerun of this script replaces its experiments
        sh([sys.executable, "-m", "dvc", "exp", "run", "-n", name, "-S", f"{a.param}={rule}",
            f"report-{a.iterations}"], pipe, env)
        results[rule] = (champion_rows(pipe, a.iterations), time.time() - t0)
        print(table({rule: results[rule]}), flush=True)
    out = table(results)
    print(out)
    if a.table:
        a.table.write_text(out)


if __name__ == "__main__":
    main()
