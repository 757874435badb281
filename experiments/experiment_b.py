"""Environment evolution and curriculum measurements in one run: evolution claim, difficulty-predictor calibration and flaw
detection, and what each curriculum sampler selects. Prints JSON and writes PNGs (offline).

    .venv/bin/python experiments/experiment_b.py --root /tmp/expb --figures docs/figures
    (add --entropy models/base to use the base model's token entropy as a predictor feature)

1. Evolution: ``python -m apprentice evolve`` (the stage itself) on store + grid + search, generations
   0..G; the fixed reference policy (oracle slipping into a random tool call with probability eps)
   is run ``samples`` times per problem; pass rate per generation with 95 % Wilson intervals.
2. Predictor: problems of all generations split by problem id (60 / 40); logistic regression fitted
   on the training problems' reference episodes; AUC / Brier / ECE on the held-out problems' episodes,
   against two baselines (the base rate; the difficulty-vector sum alone).
3. Planted flaws in the held-out problems, observed with ``flaw_samples`` fresh episodes each:
   *infeasible* = the verifier never accepts (a subclass whose reward is always 0); *leaked* = the
   policy has memorised the solution (plays the oracle plan without slips). Residual flags are
   one-sided binomial tests at alpha; detection rate per planted kind, false-flag rate on clean ones.
4. Samplers: each sampler picks ``pick`` problems from the training pool's pass-rate table; reported:
   share with GRPO signal for a group of 4 (1 - p^4 - (1-p)^4, mean), share never solved, share
   mastered, abilities covered, mean direction scores. (Selection properties, not trained outcomes.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apprentice.config import Config  # noqa: E402
from apprentice.curriculum import SAMPLERS  # noqa: E402
from apprentice.curriculum.difficulty import (  # noqa: E402
    DifficultyPredictor,
    calibration,
    detection_rates,
    feature_frame,
    reliability_plot,
    residual_flags,
)
from apprentice.data.trajectories import read_parquet, specs_of  # noqa: E402
from apprentice.envs import FAMILIES, ProblemSpec  # noqa: E402
from apprentice.envs.evolve import abilities_of, direction_scores, hardness, noisy_oracle_episode  # noqa: E402
from apprentice.paths import Paths  # noqa: E402
from apprentice.stages import evolve as evolve_stage  # noqa: E402


def _png(spec: dict, path: Path) -> None:
    """A Vega-Lite chart as a PNG, offline (vl-convert: the project's one plotting stack)."""
    import vl_convert as vlc

    path.write_bytes(vlc.vegalite_to_png({"$schema": "https://vega.github.io/schema/vega-lite/v5.json", **spec},
                                         scale=1.5))


def evolution(args) -> tuple[dict, pd.DataFrame, dict[str, ProblemSpec]]:
    cfg = Config.model_validate({"curriculum": {"evolve": {
        "generations": args.generations, "problems": args.problems, "families": args.families,
        "reference_samples": args.samples, "reference_epsilon": args.epsilon, "seed": args.seed}}})
    t0 = time.time()
    res = evolve_stage.run(cfg, Paths(Path(args.root), 1))
    out = Path(res["out"])
    ref = read_parquet(out / "reference.parquet")
    specs = {s.problem_id: s for g in range(args.generations + 1)
             for s in specs_of(read_parquet(out / f"gen_{g}.parquet"))}
    gens = res["generations"]
    values = [{"generation": g["generation"], "series": "all (95% Wilson)", "rate": g["pass_rate"],
               "low": g["ci_low"], "high": g["ci_high"]} for g in gens]
    values += [{"generation": g["generation"], "series": fam, "rate": g["by_family"][fam]}
               for fam in args.families for g in gens if fam in g["by_family"]]
    gx = {"field": "generation", "type": "ordinal"}
    y = {"field": "rate", "type": "quantitative", "title": "reference pass rate", "scale": {"domain": [0, 1]}}
    _png({"width": 420, "height": 260, "data": {"values": values},
          "title": f"Evolution: noisy oracle (eps={args.epsilon}), {args.samples} eps/problem",
          "layer": [{"mark": {"type": "line", "point": True},
                     "encoding": {"x": gx, "y": y, "color": {"field": "series"},
                                  "strokeDash": {"field": "series", "legend": None}}},
                    {"transform": [{"filter": "isValid(datum.low)"}], "mark": "rule",
                     "encoding": {"x": gx, "y": {"field": "low", "type": "quantitative"}, "y2": {"field": "high"}}}]},
         Path(args.figures) / "b_evolution.png")
    res["wall_s"] = round(time.time() - t0, 1)
    return res, ref, specs


def _split(pid: str) -> str:
    return "train" if int(hashlib.sha256(pid.encode()).hexdigest()[:8], 16) % 10 < 6 else "test"


def predictor(args, ref: pd.DataFrame, specs: dict[str, ProblemSpec]) -> tuple[dict, DifficultyPredictor, pd.DataFrame]:
    ids = sorted(specs)
    feats = feature_frame([specs[i] for i in ids])
    feats["hardness_sum"] = [sum(hardness(specs[i]).values()) for i in ids]
    if args.entropy:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from apprentice.curriculum.difficulty import token_entropy

        tok = AutoTokenizer.from_pretrained(args.entropy)
        model = AutoModelForCausalLM.from_pretrained(args.entropy)
        texts = [FAMILIES[specs[i].family]().reset(spec=specs[i]) for i in ids]
        feats["entropy"] = token_entropy(texts, model, tok)
    split = pd.Series({i: _split(i) for i in ids})
    ref = ref.assign(split=ref["problem_id"].map(split))
    tr, te = ref[ref["split"] == "train"], ref[ref["split"] == "test"]
    y_tr, y_te = tr["success"].to_numpy(int), te["success"].to_numpy(int)
    out: dict = {"train_problems": int((split == "train").sum()), "test_problems": int((split == "test").sum()),
                 "train_episodes": len(tr), "test_episodes": len(te)}
    base = np.full(len(te), y_tr.mean())
    out["base_rate"] = calibration(y_te, base)
    variants = {"difficulty_sum": ["family", "hardness_sum"],
                "spec_features": [c for c in feats.columns if c not in ("hardness_sum", "entropy")]}
    if args.entropy:
        variants["spec_features+entropy"] = [*variants["spec_features"], "entropy"]
        variants["entropy_only"] = ["family", "entropy"]
    best = None
    plt_done = False
    for name, cols in variants.items():
        m = DifficultyPredictor().fit(feats.loc[tr["problem_id"], cols], y_tr)
        p = m.predict(feats.loc[te["problem_id"], cols])
        out[name] = calibration(y_te, p)
        if name == "spec_features":
            best = (m, cols)
            out[name]["coefficients"] = {k: round(v, 3) for k, v in m.coefficients().items()}
            reliability_plot(y_te, p, Path(args.figures) / "b_reliability.png", title="Held-out problems")
            plt_done = True
    assert plt_done and best is not None
    model, cols = best
    return out, model, feats[cols]


def flaws(args, model: DifficultyPredictor, feats: pd.DataFrame, specs: dict[str, ProblemSpec]) -> dict:
    test_ids = [i for i in sorted(specs) if _split(i) == "test"]
    rng = random.Random(args.seed + 17)
    shuffled = test_ids[:]
    rng.shuffle(shuffled)
    k = int(len(shuffled) * args.plant_share)
    planted = {i: "infeasible" for i in shuffled[:k]} | {i: "leaked" for i in shuffled[k:2 * k]}
    broken = {}
    for fam, cls in FAMILIES.items():
        broken[fam] = type(f"Broken{cls.__name__}", (cls,), {"get_reward": lambda self: 0.0})
    rows = []
    for i in test_ids:
        s, kind = specs[i], planted.get(i, "clean")
        succ = 0
        for _ in range(args.flaw_samples):
            if kind == "infeasible":
                ep = noisy_oracle_episode(s, args.epsilon, rng, env_cls=broken[s.family])
            else:
                ep = noisy_oracle_episode(s, 0.0 if kind == "leaked" else args.epsilon, rng)
            succ += int(ep["success"])
        rows.append({"problem_id": i, "successes": succ, "attempts": args.flaw_samples, "kind": kind})
    tab = pd.DataFrame(rows)
    tab["predicted"] = model.predict(feats.loc[tab["problem_id"]])
    flagged = residual_flags(tab, alpha=args.alpha)
    res = detection_rates(flagged, planted)
    for kind, cond, flag in (("infeasible", flagged["predicted"] >= 0.5, "infeasible?"),
                             ("leaked", flagged["predicted"] < 0.5, "leaked?")):
        m = (flagged["kind"] == kind) & cond
        res[f"{kind}_detectable_share"] = float(cond[flagged["kind"] == kind].mean())
        res[f"{kind}_detected_where_detectable"] = float((flagged.loc[m, "flag"] == flag).mean()) if m.any() else None
    res["alpha"] = args.alpha
    res["samples_per_problem"] = args.flaw_samples
    kinds = ["clean", "infeasible", "leaked"]
    points = [{"kind": k, "predicted": float(p), "observed": float(o) + float(rng.uniform(-0.015, 0.015))}
              for k in kinds for p, o in flagged.loc[flagged["kind"] == k, ["predicted", "observed"]].itertuples(
                  index=False)]
    px = {"field": "predicted", "type": "quantitative", "title": "predicted success"}
    py = {"field": "observed", "type": "quantitative", "title": f"observed ({args.flaw_samples} episodes)"}
    _png({"width": 420, "height": 260,
          "title": f"Residuals: infeasible {res['infeasible_detected']:.0%}, leaked {res['leaked_detected']:.0%}, "
                   f"false {res['clean_false_flag_rate']:.0%}",
          "layer": [{"data": {"values": points}, "mark": {"type": "point", "filled": True, "opacity": 0.7},
                     "encoding": {"x": px, "y": py, "color": {"field": "kind", "sort": kinds,
                                                              "scale": {"range": ["grey", "red", "blue"]}}}},
                    {"data": {"values": [{"predicted": 0, "observed": 0}, {"predicted": 1, "observed": 1}]},
                     "mark": {"type": "line", "strokeDash": [4, 4], "color": "black"},
                     "encoding": {"x": px, "y": py}}]},
         Path(args.figures) / "b_residuals.png")
    return res


def samplers(args, ref: pd.DataFrame, specs: dict[str, ProblemSpec]) -> dict:
    tr = ref[ref["problem_id"].map(_split) == "train"]
    t = tr.groupby("problem_id").agg(attempts=("success", "size"), successes=("success", "sum")).reset_index()
    t["pass_rate"] = t["successes"] / t["attempts"]
    dirs = pd.DataFrame([direction_scores(specs[i]) for i in t["problem_id"]])
    t = pd.concat([t, dirs], axis=1)
    t["abilities"] = [sorted(abilities_of(specs[i])) for i in t["problem_id"]]
    universe = set().union(*map(set, t["abilities"]))
    rng = random.Random(args.seed)
    picks = {name: fn(t, args.pick, seed=args.seed) for name, fn in SAMPLERS.items()}
    picks["random"] = rng.sample(list(t["problem_id"]), args.pick)
    out = {}
    idx = t.set_index("problem_id")
    for name, ids in picks.items():
        sel = idx.loc[ids]
        p = sel["pass_rate"]
        out[name] = {
            "n": len(ids),
            "grpo_signal_g4": round(float((1 - p ** 4 - (1 - p) ** 4).mean()), 3),
            "never_solved": round(float((p == 0).mean()), 3),
            "mastered": round(float((p >= 0.9).mean()), 3),
            "abilities_covered": round(len(set().union(*map(set, sel["abilities"]))) / len(universe), 3),
            **{f"mean_{d}": round(float(sel[d].mean()), 2) for d in ("horizon", "state", "harness")},
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/tmp/apprentice-expb")
    ap.add_argument("--figures", default="docs/figures")
    ap.add_argument("--families", nargs="+", default=["store", "grid", "search"])
    ap.add_argument("--problems", type=int, default=150)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--epsilon", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--flaw-samples", type=int, default=8)
    ap.add_argument("--plant-share", type=float, default=0.15)
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--pick", type=int, default=60)
    ap.add_argument("--entropy", default="", help="HF model folder for the token-entropy feature (optional)")
    args = ap.parse_args()
    Path(args.figures).mkdir(parents=True, exist_ok=True)
    evo, ref, specs = evolution(args)
    pred, model, feats = predictor(args, ref, specs)
    det = flaws(args, model, feats, specs)
    samp = samplers(args, ref, specs)
    print(json.dumps({"evolution": {k: v for k, v in evo.items() if k != "settings"}, "predictor": pred,
                      "flaws": det, "samplers": samp}, indent=2, default=float))


if __name__ == "__main__":
    main()
