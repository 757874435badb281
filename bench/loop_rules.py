"""Issue L: compare the loop rules (``loop.rule``) by the champion they leave, one ``dvc exp run`` each.

    .venv/bin/python bench/loop_rules.py --profile default --workdir /tmp/loop-rules --iterations 2
    .venv/bin/python bench/loop_rules.py --profile quick   --workdir /tmp/loop-rules-quick

What it does, all through DVC (nothing here trains or evaluates by itself):
  1. a throwaway clone of HEAD (``bench/sampler_sweep.py::prepare``: ``dvc exp`` rewrites params.yaml
     in its workspace); ``--iterations`` K must not exceed the profile's ``pipeline.iterations`` (the
     generated dvc.yaml declares that many; default 2);
  2. per rule, ``dvc exp run -n loop-<rule> -S loop.rule=<rule> report-<K>``:
     the same seeds everywhere (pipeline/synth/benchmark/rollout/SFT/RL seeds untouched), so
     iteration 1 is identical and cached after the first rule; every later iteration reruns from
     loop-data on;
  3. per rule and iteration, from the experiment's own files (``dvc.api``, ``rev=<experiment>``): the
     champion after promote-k, its benchmark success with the 95 % Wilson interval, the exact McNemar
     test against the champion after promote-(k-1) on the same benchmark episodes, per-family
     success, and the wall time of the experiment; printed and written as the Markdown table of
     docs/experiments.md (``--table``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sampler_sweep import prepare, sh  # noqa: E402

RULES = ("continue", "restart", "self", "repair")


def _read(path: str, rev: str, pipe: Path, binary: bool = False):  # noqa: ANN202
    """``path`` (relative to the pipeline dir ``pipe``) as of experiment ``rev``; dvc.api wants the git root."""
    import dvc.api

    root = Path(sh(["git", "rev-parse", "--show-toplevel"], pipe, dict(os.environ)).strip())
    prefix = pipe.resolve().relative_to(root.resolve()).as_posix()
    full = f"{prefix}/{path}" if prefix != "." else path
    return dvc.api.read(full, repo=str(root), rev=rev, mode="rb" if binary else "r")


def champion_rows(pipe: Path, rev: str, iterations: int) -> list[dict]:
    import pandas as pd

    from apprentice.evaluation import paired_test, summarize

    rows, prev = [], None
    for k in range(1, iterations + 1):
        promo = json.loads(_read(f"reports/iter_{k}/promotion.json", rev, pipe))
        c = promo["champion"]
        path = "data/benchmark/eval/base.parquet" if c.get("kind") == "base" else \
            f"data/iter_{c['iteration']}/eval/{c['kind']}.parquet"
        eps = pd.read_parquet(io.BytesIO(_read(path, rev, pipe, binary=True)))
        m = summarize(eps)
        row = {"iteration": k, "champion": "base" if c.get("kind") == "base" else
               f"v{c['version']} iter {c['iteration']} {c['kind']}", "success": m["success_rate"],
               "lo": m["success_ci_low"], "hi": m["success_ci_high"],
               "families": {key.split("/")[0].removeprefix("family_"): v for key, v in m.items()
                            if key.startswith("family_") and key.endswith("/success_rate")}}
        if prev is not None:
            t = paired_test(eps, prev)
            row["mcnemar"] = f"{t['a_only']} / {t['b_only']}, p = {t['p_value']:.3g}"
        rows.append(row)
        prev = eps
    return rows


def table(results: dict[str, tuple[list[dict], float]]) -> str:
    lines = ["| rule | iteration | champion | success [95 % CI] | vs previous champion: only new / only old, "
             "McNemar | per family | wall time |", "|---|---|---|---|---|---|---|"]
    for rule, (rows, wall) in results.items():
        for r in rows:
            fam = ", ".join(f"{f} {100 * v:.0f}%" for f, v in sorted(r["families"].items()))
            lines.append(f"| {rule} | {r['iteration']} | {r['champion']} | {100 * r['success']:.1f}% "
                         f"[{100 * r['lo']:.0f}, {100 * r['hi']:.0f}] | {r.get('mcnemar', '-')} | {fam} | "
                         f"{wall / 60:.1f} min |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="default")
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES)
    ap.add_argument("--table", type=Path, help="also write the Markdown table here")
    a = ap.parse_args()
    env = {**os.environ, "APPRENTICE_QUIET": "1", "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # dvc runs `python -m apprentice`
    pipe = prepare(a.workdir, a.profile, env)
    results: dict[str, tuple[list[dict], float]] = {}
    for rule in a.rules:
        t0 = time.time()
        sh([sys.executable, "-m", "dvc", "exp", "run", "-n", f"loop-{rule}", "-S", f"loop.rule={rule}",
            f"report-{a.iterations}"], pipe, env)
        results[rule] = (champion_rows(pipe, f"loop-{rule}", a.iterations), time.time() - t0)
        print(table({rule: results[rule]}), flush=True)
    out = table(results)
    print(out)
    if a.table:
        a.table.write_text(out)


if __name__ == "__main__":
    main()
