"""Does selecting training problems by *predicted* pass rate (``synth.sampler``) land where
the sampler aims, for a real trained model?

    .venv/bin/python experiments/synth_selection.py --episodes data/iter_1/eval/rl.parquet --model models/iter_1/rl

1. fits the ex-ante difficulty predictor on ``--episodes`` (a model's held-out episodes of iteration 1,
   what ``synth`` reads in iteration 2) and lets ``synth.sampler`` pick ``--n`` of ``--n x oversample``
   fresh iteration-2 candidates, exactly as the synth stage does (``stages.synth.select_train``);
2. runs ``--model`` (greedy, the evaluation settings) on the picked problems and on ``--n`` of the
   candidates it did not pick, and prints predicted vs observed pass rates of both, with 95 % Wilson
   intervals, plus the predictor's out-of-sample AUC / Brier / ECE on all of them.

No rollout is spent to *select*; the rollouts here only check the selection. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=Path, required=True, help="held-out episodes the predictor is fitted on")
    p.add_argument("--model", type=Path, required=True, help="the model those episodes came from")
    p.add_argument("--params", type=Path, default=REPO / "params.yaml")
    p.add_argument("--sampler", default="pass_band")
    p.add_argument("--p-star", type=float, default=0.5)
    p.add_argument("--band", type=float, default=0.15)
    p.add_argument("--n", type=int, default=40)
    p.add_argument("--oversample", type=float, default=4.0)
    p.add_argument("--out", type=Path, help="also write the JSON result here")
    args = p.parse_args(argv)

    from apprentice.config import load_config
    from apprentice.curriculum import difficulty
    from apprentice.evaluation.metrics import wilson_interval
    from apprentice.lm.modeling import load_model, load_tokenizer
    from apprentice.policies.hf_cached import CachedHFPolicy
    from apprentice.rollout.episodes import run_episodes
    from apprentice.stages import synth

    cfg = load_config(args.params, overrides=[
        f"synth.sampler={args.sampler}", f"synth.oversample={args.oversample}", f"synth.n_train={args.n}",
        f"curriculum.p_star={args.p_star}", f"curriculum.band={args.band}"])
    n_cand = int(np.ceil(args.n * args.oversample))
    cands = [synth._generator(f)(seed, lv) for f, lv, seed in synth.plan(cfg, 2, "train", n_cand)]
    keep, info = synth.select_train(cfg, cands, args.episodes, args.n)
    pred, _ = synth.predict_pass_rates(args.episodes, cands)
    rest = [i for i in range(len(cands)) if i not in set(keep)]
    other = sorted(random.Random(0).sample(rest, min(args.n, len(rest))))

    ec = cfg.evaluate
    tok = load_tokenizer(str(args.model), cfg.model.chat_template)
    policy = CachedHFPolicy(load_model(str(args.model), dtype="fp32"), tok, temperature=ec.temperature,
                            max_new_tokens=ec.max_new_tokens, batch_size=ec.batch_size, dtype=cfg.model.dtype,
                            seed=0, policy_id=str(args.model))
    out: dict = {"selection": info}
    ys, ps = [], []
    for name, idx in (("picked", keep), ("not_picked", other)):
        specs = [cands[i] for i in idx]
        trajs = run_episodes(specs, policy,
                             samples_per_problem=1, batch_size=ec.batch_size, seed=0, progress=True,
                             max_format_errors=ec.max_format_errors)
        ok = {t.problem_id: t.success for t in trajs}
        y = [int(ok[s.problem_id]) for s in specs]
        lo, hi = wilson_interval(sum(y), len(y))
        out[name] = {"n": len(y), "predicted": round(float(np.mean(pred[idx])), 3),
                     "observed": round(sum(y) / len(y), 3), "ci": [round(lo, 3), round(hi, 3)]}
        ys += y
        ps += [float(pred[i]) for i in idx]
    out["predictor_out_of_sample"] = {k: round(v, 3) for k, v in difficulty.calibration(ys, ps).items()}
    print(json.dumps(out))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
