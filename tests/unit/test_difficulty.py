"""Difficulty predictor: metrics against hand-computed values; residuals flag planted flaws."""

from __future__ import annotations

import random

import numpy as np
import pandas as pd
import pytest

from apprentice.curriculum.difficulty import (
    DifficultyPredictor,
    calibration,
    detection_rates,
    feature_frame,
    reliability_plot,
    reliability_table,
    residual_flags,
)
from apprentice.envs import FAMILIES
from apprentice.envs.evolve import noisy_oracle_episode

Y = [0, 0, 1, 1]
P = [0.1, 0.4, 0.35, 0.8]


def test_metrics_match_hand_computed_values():
    m = calibration(Y, P, bins=2)
    assert m["auc"] == pytest.approx(0.75)  # pairs (pos, neg): .35>.1, .35<.4, .8>.1, .8>.4 -> 3/4
    assert m["brier"] == pytest.approx((0.01 + 0.16 + 0.4225 + 0.04) / 4)
    # bin [0, .5): conf (.1+.4+.35)/3, acc 1/3, weight 3/4; bin [.5, 1]: conf .8, acc 1, weight 1/4
    assert m["ece"] == pytest.approx(0.75 * abs(1 / 3 - 0.85 / 3) + 0.25 * 0.2)
    tab = reliability_table(Y, P, bins=2)
    assert list(tab["count"]) == [3, 1]


def test_auc_can_hide_a_bad_estimate():
    """Same ranking, probabilities shifted: AUC identical, Brier and ECE much worse."""
    good, shifted = calibration(Y, P), calibration(Y, [p * 0.2 for p in P])
    assert good["auc"] == shifted["auc"]
    assert shifted["ece"] > good["ece"] and shifted["brier"] > good["brier"]


def test_reliability_plot_writes_png(tmp_path):
    out = reliability_plot(Y, P, tmp_path / "rel.png", bins=2)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_residual_flags_on_hand_fixture():
    t = pd.DataFrame({"problem_id": ["inf", "clean", "leak", "few"], "predicted": [0.9, 0.9, 0.2, 0.9],
                      "successes": [0, 7, 8, 0], "attempts": [8, 8, 8, 1]})
    f = residual_flags(t, alpha=0.01).set_index("problem_id")
    assert f.loc["inf", "flag"] == "infeasible?" and f.loc["inf", "p_low"] == pytest.approx(0.1 ** 8)
    assert f.loc["leak", "flag"] == "leaked?" and f.loc["leak", "p_high"] == pytest.approx(0.2 ** 8)
    assert f.loc["clean", "flag"] == "" and f.loc["few", "flag"] == ""  # 0/1 at p=.9 is not evidence
    assert f.loc["inf", "residual"] == pytest.approx(0.9)
    rates = detection_rates(f.reset_index(), {"inf": "infeasible", "leak": "leaked", "few": "infeasible"})
    assert rates["infeasible_detected"] == 0.5 and rates["leaked_detected"] == 1.0
    assert rates["clean_false_flag_rate"] == 0.0


def test_predictor_on_real_rollouts_finds_planted_infeasible_problems():
    """Fit on noisy-oracle rollouts of store problems; plant broken verifiers in held-out problems."""
    cls = FAMILIES["store"]
    rng = random.Random(0)
    specs = [cls.generate(s, s % 4) for s in range(48)]
    train, test = specs[:32], specs[32:]
    eps, n = 0.25, 6

    def outcomes(ss):
        return [[noisy_oracle_episode(s, eps, rng)["success"] for _ in range(n)] for s in ss]

    tr = outcomes(train)
    feats = feature_frame(train)
    rep = feats.loc[feats.index.repeat(n)]
    pred = DifficultyPredictor().fit(rep, np.concatenate(tr))
    assert pred.coefficients()["plan_len"] < 0  # longer plans -> fewer successes
    te_obs = outcomes(test)
    planted = {s.problem_id: "infeasible" for s in test[:6]}
    succ = [0 if s.problem_id in planted else sum(o) for s, o in zip(test, te_obs, strict=True)]
    tab = pd.DataFrame({"problem_id": [s.problem_id for s in test], "predicted": pred.predict(feature_frame(test)),
                        "successes": succ, "attempts": n})
    flags = residual_flags(tab, alpha=0.05)
    rates = detection_rates(flags, planted)
    easy = tab["predicted"] > 0.6  # an infeasible problem is only detectable where success was expected
    flagged_easy = flags[easy & flags["problem_id"].isin(planted)]
    assert (flagged_easy["flag"] == "infeasible?").all()
    assert rates["infeasible_detected"] >= 0.5
    assert rates["clean_false_flag_rate"] <= 0.2


def test_token_entropy_is_bounded_by_the_vocabulary(tiny_model_dir):
    import math

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from apprentice.curriculum.difficulty import token_entropy

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ent = token_entropy(["Order 2 x the blue mug for Ana Ruiz.", "Cancel order #3.", "x"], model, tok, batch_size=2)
    assert len(ent) == 3 and ent[2] == 0.0  # one token: nothing to predict
    assert all(0 < e <= math.log(len(tok)) + 1e-4 for e in ent[:2])
    # padding must not change a text's value
    assert token_entropy(["Cancel order #3."], model, tok)[0] == pytest.approx(ent[1], rel=1e-4)
