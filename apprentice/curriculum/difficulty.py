"""Ex-ante difficulty: predict a policy's success on a problem from its spec and text, before any rollout.

The method is ex-ante difficulty prediction for agentic tasks: difficulty can be forecast from the
task description; token-level entropy is a useful signal; judge the forecast by *calibration*,
because AUC only ranks and can hide probabilities that are far off; and the residual predicted −
observed exposes broken problems: a problem the policy fails far more often than predicted is
suspect of being infeasible, one it solves far more often than predicted is suspect of being leaked
into its training data.

Pieces (all plain functions over pandas / numpy, scikit-learn does the fitting):
  * :func:`feature_frame`  spec -> features: the three evolution-direction scores, the oracle plan's
    length and distinct tools, the turn budget's slack, the task text's length, the family; plus an
    optional per-problem ``entropy`` column (:func:`token_entropy`, the student's mean next-token
    entropy over the problem text);
  * :class:`DifficultyPredictor`  standardised logistic regression fitted on episode outcomes;
  * :func:`calibration`  AUC, Brier score, expected calibration error (equal-width bins);
    :func:`reliability_table` / :func:`reliability_plot` (Vega-Lite via vl-convert, offline PNG);
  * :func:`residual_flags`  per-problem one-sided binomial tests of the observed successes against
    the predicted probability; :func:`detection_rates` scores them against planted labels.

Why hand-written ECE and the flagging rule: scikit-learn has AUC, Brier and ``calibration_curve``
but no ECE, and the flagging rule is ours (a binomial tail test, so a problem seen 8 times is judged
with the uncertainty 8 samples carry, not with a fixed residual cut-off).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy.stats import binom

from apprentice.envs import FAMILIES, ProblemSpec
from apprentice.envs.evolve import direction_scores

__all__ = ["DifficultyPredictor", "calibration", "detection_rates", "feature_frame", "reliability_plot",
           "reliability_table", "residual_flags", "token_entropy"]


def spec_features(spec: ProblemSpec) -> dict[str, Any]:
    env = FAMILIES[spec.family]()
    text = env.reset(spec=spec)
    plan = env.oracle()
    return {
        "problem_id": spec.problem_id,
        "family": spec.family,
        **direction_scores(spec),
        "plan_len": len(plan),
        "plan_tools": len({c.name for c in plan}),
        "slack": env.turn_budget() - len(plan),
        "text_words": len(text.split()),
    }


def feature_frame(specs: Sequence[ProblemSpec], entropy: Sequence[float] | None = None) -> pd.DataFrame:
    """One row per spec, indexed by problem_id."""
    df = pd.DataFrame([spec_features(s) for s in specs]).set_index("problem_id")
    if entropy is not None:
        df["entropy"] = list(entropy)
    return df


class DifficultyPredictor:
    """P(success | features): one-hot family + standardised numeric features -> logistic regression."""

    def __init__(self, C: float = 1.0) -> None:
        self.C = C
        self.columns: list[str] = []
        self.families: list[str] = []
        self.model: Any = None

    def _design(self, feats: pd.DataFrame) -> np.ndarray:
        num = feats[self.columns].to_numpy(dtype=float)
        fam = np.stack([(feats["family"] == f).to_numpy(dtype=float) for f in self.families], axis=1) \
            if self.families else np.zeros((len(feats), 0))
        return np.concatenate([num, fam], axis=1)

    def fit(self, feats: pd.DataFrame, success: Sequence[bool] | np.ndarray) -> DifficultyPredictor:
        """``feats`` has one row per *episode* (repeat a problem's features per sample)."""
        from sklearn.linear_model import LogisticRegression
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        y = np.asarray(success, dtype=int)
        if len(set(y.tolist())) < 2:
            raise ValueError("the fitting rollouts are all successes or all failures; a predictor needs both "
                             "(use harder or easier problems, or a noisier reference policy)")
        self.columns = [c for c in feats.columns if c != "family" and pd.api.types.is_numeric_dtype(feats[c])]
        self.families = sorted(feats["family"].unique()) if "family" in feats else []
        self.model = make_pipeline(StandardScaler(), LogisticRegression(C=self.C, max_iter=1000))
        self.model.fit(self._design(feats), y)
        return self

    def predict(self, feats: pd.DataFrame) -> np.ndarray:
        if self.model is None:
            raise RuntimeError("fit the predictor first")
        return self.model.predict_proba(self._design(feats))[:, 1]

    def coefficients(self) -> dict[str, float]:
        lr = self.model[-1]
        return dict(zip([*self.columns, *(f"family={f}" for f in self.families)], lr.coef_[0].tolist(), strict=True))


# ---- calibration metrics ------------------------------------------------------------------------
def reliability_table(y: Sequence[int] | np.ndarray, p: Sequence[float] | np.ndarray, bins: int = 10) -> pd.DataFrame:
    """Equal-width bins over [0, 1]: count, mean predicted (confidence), observed rate (accuracy)."""
    y, p = np.asarray(y, dtype=float), np.asarray(p, dtype=float)
    idx = np.minimum((np.asarray(p) * bins).astype(int), bins - 1)
    rows = []
    for b in range(bins):
        m = idx == b
        if m.any():
            rows.append({"bin": b, "lo": b / bins, "hi": (b + 1) / bins, "count": int(m.sum()),
                         "confidence": float(p[m].mean()), "accuracy": float(y[m].mean())})
    return pd.DataFrame(rows)


def calibration(y: Sequence[int] | np.ndarray, p: Sequence[float] | np.ndarray, bins: int = 10) -> dict[str, float]:
    """AUC (ranking), Brier score (mean squared error of the probability) and ECE
    (sum over bins of count/N * |accuracy - confidence|)."""
    from sklearn.metrics import roc_auc_score

    y_arr, p_arr = np.asarray(y, dtype=float), np.asarray(p, dtype=float)
    tab = reliability_table(y_arr, p_arr, bins)
    ece = float((tab["count"] / len(y_arr) * (tab["accuracy"] - tab["confidence"]).abs()).sum())
    auc = float(roc_auc_score(y_arr, p_arr)) if len(set(y_arr.tolist())) == 2 else float("nan")
    return {"auc": auc, "brier": float(np.mean((p_arr - y_arr) ** 2)), "ece": ece, "n": int(len(y_arr)),
            "base_rate": float(y_arr.mean())}


def reliability_plot(y: Sequence[int], p: Sequence[float], path: str | Path, bins: int = 10,
                     title: str = "Reliability") -> Path:
    """Reliability diagram (observed vs predicted per bin, each point labelled with its count) as a
    PNG, offline: Vega-Lite rendered by ``vl-convert`` (bundled engine), the project's one plotting stack."""
    import json

    import vl_convert as vlc

    from apprentice.paths import atomic_path

    tab = reliability_table(y, p, bins)
    m = calibration(y, p, bins)
    points = json.loads(tab[["confidence", "accuracy", "count"]].to_json(orient="records"))
    x = {"field": "confidence", "type": "quantitative", "title": "predicted success", "scale": {"domain": [0, 1]}}
    yy = {"field": "accuracy", "type": "quantitative", "title": "observed success", "scale": {"domain": [0, 1]}}
    spec = {
        "$schema": "https://vega.github.io/schema/vega-lite/v5.json", "width": 360, "height": 360,
        "title": {"text": title, "subtitle": f"AUC {m['auc']:.3f}  Brier {m['brier']:.3f}  ECE {m['ece']:.3f}"},
        "layer": [
            {"data": {"values": [{"confidence": 0, "accuracy": 0}, {"confidence": 1, "accuracy": 1}]},
             "mark": {"type": "line", "strokeDash": [4, 4], "color": "grey"}, "encoding": {"x": x, "y": yy}},
            {"data": {"values": points}, "mark": {"type": "line", "point": True}, "encoding": {"x": x, "y": yy}},
            {"data": {"values": points}, "mark": {"type": "text", "dx": 8, "dy": 10, "fontSize": 9},
             "encoding": {"x": x, "y": yy, "text": {"field": "count", "type": "quantitative"}}},
        ],
    }
    path = Path(path)
    with atomic_path(path) as tmp:
        tmp.write_bytes(vlc.vegalite_to_png(spec, scale=1.5))
    return path


# ---- residuals ----------------------------------------------------------------------------------
def residual_flags(table: pd.DataFrame, alpha: float = 0.01) -> pd.DataFrame:
    """Per problem (columns ``problem_id``, ``predicted``, ``successes``, ``attempts``): residual =
    predicted − observed rate, and one-sided binomial tails under the predicted probability.

    ``flag`` = "infeasible?" when P(X <= successes) < alpha (far fewer successes than predicted),
    "leaked?" when P(X >= successes) < alpha (far more), else "". With few attempts nothing can be
    flagged unless the prediction is confident: the test carries the sample size."""
    t = table.copy()
    n, k, p = t["attempts"].to_numpy(), t["successes"].to_numpy(), t["predicted"].to_numpy().clip(1e-6, 1 - 1e-6)
    t["observed"] = k / np.maximum(n, 1)
    t["residual"] = t["predicted"] - t["observed"]
    t["p_low"] = binom.cdf(k, n, p)
    t["p_high"] = binom.sf(k - 1, n, p)
    t["flag"] = np.where(t["p_low"] < alpha, "infeasible?", np.where(t["p_high"] < alpha, "leaked?", ""))
    return t


def detection_rates(flags: pd.DataFrame, planted: Mapping[str, str]) -> dict[str, Any]:
    """Recall of each planted kind ("infeasible", "leaked") by its matching flag, and the false-flag
    rate on clean problems (any flag)."""
    lab = flags["problem_id"].map(lambda pid: planted.get(pid, "clean"))
    out: dict[str, Any] = {}
    for kind, flag in (("infeasible", "infeasible?"), ("leaked", "leaked?")):
        m = lab == kind
        out[f"{kind}_planted"] = int(m.sum())
        out[f"{kind}_detected"] = float((flags.loc[m, "flag"] == flag).mean()) if m.any() else float("nan")
    clean = lab == "clean"
    out["clean"] = int(clean.sum())
    out["clean_false_flag_rate"] = float((flags.loc[clean, "flag"] != "").mean()) if clean.any() else float("nan")
    return out


# ---- optional: the student's token entropy on the problem text ----------------------------------
def token_entropy(texts: Sequence[str], model: Any, tokenizer: Any, batch_size: int = 8,
                  max_length: int = 256) -> list[float]:
    """Mean next-token entropy (nats) of ``model`` over each text: how unsure the student is about
    the problem's wording. Uses torch/transformers lazily so the rest of this module stays light."""
    import torch

    out: list[float] = []
    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for i in range(0, len(texts), batch_size):
        enc = [tokenizer(t, truncation=True, max_length=max_length)["input_ids"] for t in texts[i:i + batch_size]]
        width = max(len(e) for e in enc)
        ids = torch.tensor([e + [pad] * (width - len(e)) for e in enc])
        mask = torch.tensor([[1] * len(e) + [0] * (width - len(e)) for e in enc])  # right padding
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
        logp = torch.log_softmax(logits, dim=-1)
        ent = -(logp.exp() * logp).sum(-1)  # [batch, width]; position j predicts token j+1
        for row, e in enumerate(enc):
            out.append(float(ent[row, : len(e) - 1].mean()) if len(e) > 1 else 0.0)
    return out


def summary_json(metrics: Mapping[str, Any]) -> str:
    return json.dumps(dict(metrics), indent=2, sort_keys=True, default=float)
