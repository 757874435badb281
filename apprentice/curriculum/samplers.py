"""Curriculum samplers: which problems to spend rollouts on, chosen by one param (``curriculum.sampler``).

Every sampler is a pure function ``(table, n, ...) -> list[problem_id]`` over a *pass-rate table*, a
pandas frame with one row per problem:

  ``problem_id``  str
  ``attempts``    int, episodes observed for the current policy (probe or earlier rollouts)
  ``successes``   int
  ``pass_rate``   float (derived from the two above when missing)
  ``horizon``, ``state``, ``harness``   int, the problem's position along the three evolution
                  directions (``apprentice.envs.evolve.direction_scores``; hdc needs them)
  ``abilities``   list[str] or JSON list (aes needs it): what solving the problem exercises

so they can be tested on synthetic tables and reused by RL (order the training prompts) and by
synthesis (pick which problems to keep). The frame is built from the stages' pass rates by
:func:`apprentice.curriculum.table.table_from_rates`; :func:`keep_predicted` is synthesis's entry
point, and the RL stage reaches :func:`order_problems` through
:func:`apprentice.curriculum.filter.keep_for_grpo`. Why hand-written: the rules are a few lines
each and come from papers that ship no reusable library (the pass-rate band: AdvSim2Real's generator
is rewarded for problems the agent solves about half the time; DTAC; HDC; AES). Ties are broken by a
seeded hash of the problem id, so the order is reproducible and does not depend on row order.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd

from apprentice.curriculum.table import PassRate, table_from_rates

__all__ = ["SAMPLERS", "SAMPLER_SETTINGS", "aes", "dtac", "hdc", "keep_predicted", "order_problems", "pass_band",
           "sample"]


def _tiebreak(pid: str, seed: int) -> str:
    return hashlib.sha256(f"{seed}:{pid}".encode()).hexdigest()


def _prepared(table: pd.DataFrame) -> pd.DataFrame:
    t = table.copy()
    if "problem_id" not in t:
        raise ValueError("pass-rate table needs a 'problem_id' column (see apprentice.curriculum.samplers docstring)")
    if "pass_rate" not in t:
        if not {"attempts", "successes"} <= set(t):
            raise ValueError("pass-rate table needs 'pass_rate' or both 'attempts' and 'successes'")
        t["pass_rate"] = t["successes"] / t["attempts"].where(t["attempts"] > 0)
    if "attempts" not in t:
        t["attempts"] = 1
    if "successes" not in t:
        t["successes"] = (t["pass_rate"] * t["attempts"]).round().fillna(0).astype(int)
    t["problem_id"] = t["problem_id"].astype(str)
    return t


def pass_band(table: pd.DataFrame, n: int | None = None, *, p_star: float = 0.5, band: float = 0.35,
              seed: int = 0, **_: Any) -> list[str]:
    """Problems whose pass rate lies within ``band`` of ``p_star``, closest first.

    A problem solved about ``p_star`` of the time gives GRPO the most within-group reward variance
    (p(1-p) peaks at 1/2); unprobed problems (NaN) are left out."""
    t = _prepared(table).dropna(subset=["pass_rate"])
    t = t[(t["pass_rate"] - p_star).abs() <= band + 1e-12]
    keyed = sorted(t.itertuples(), key=lambda r: (abs(r.pass_rate - p_star), _tiebreak(r.problem_id, seed)))
    ids = [r.problem_id for r in keyed]
    return ids[:n] if n is not None else ids


def _pools(t: pd.DataFrame, hard_threshold: float, easy_threshold: float, min_attempts: int) -> dict[str, pd.DataFrame]:
    p = t["pass_rate"]
    return {
        "learnable": t[(p > hard_threshold) & (p < easy_threshold)],
        "hard_won": t[(p > 0) & (p <= hard_threshold)],
        "infeasible": t[(p == 0) & (t["attempts"] >= min_attempts)],
    }


def dtac(table: pd.DataFrame, n: int, *, replay_share: float = 0.2, infeasible_share: float = 0.1,
         hard_threshold: float = 0.25, easy_threshold: float = 0.9, min_attempts: int = 2,
         p_star: float = 0.5, seed: int = 0, **_: Any) -> list[str]:
    """DTAC-style mix of three pools (EvoCUA-1.5):

    * ``round(n * replay_share)`` *hard-won* problems (0 < pass rate <= hard_threshold): their rare
      successes are the most informative positives, so they are replayed, rarest first;
    * ``round(n * infeasible_share)`` *infeasible* ones (never solved in >= min_attempts tries): a
      controlled dose keeps the policy from learning that every problem has a solution;
    * the rest *learnable* (hard_threshold < pass rate < easy_threshold), closest to p_star first.

    A pool that runs short is topped up from learnable, then hard-won. Mastered problems (pass rate
    >= easy_threshold) and unprobed ones are never chosen. The pools are interleaved evenly so that
    any prefix of the order keeps roughly the same mix."""
    t = _prepared(table).dropna(subset=["pass_rate"])
    pools = _pools(t, hard_threshold, easy_threshold, min_attempts)

    keys: dict[str, Callable[[Any], tuple]] = {
        "learnable": lambda r: (abs(r.pass_rate - p_star), _tiebreak(r.problem_id, seed)),
        "hard_won": lambda r: (r.pass_rate, _tiebreak(r.problem_id, seed)),  # rarest successes first
        "infeasible": lambda r: (_tiebreak(r.problem_id, seed),),
    }

    def ranked(name: str) -> list[str]:
        return [r.problem_id for r in sorted(pools[name].itertuples(), key=keys[name])]

    avail = {k: ranked(k) for k in pools}
    want = {"hard_won": round(n * replay_share), "infeasible": round(n * infeasible_share)}
    take = {k: avail[k][: want[k]] for k in want}
    take["learnable"] = avail["learnable"][: max(0, n - len(take["hard_won"]) - len(take["infeasible"]))]
    short = n - sum(len(v) for v in take.values())
    for k in ("learnable", "hard_won"):  # top-up order
        if short <= 0:
            break
        extra = avail[k][len(take[k]): len(take[k]) + short]
        take[k] = take[k] + extra
        short -= len(extra)
    # even interleave: each id gets a fractional position i/len(pool) within its pool
    slots = [((i + 0.5) / len(ids), k, pid) for k, ids in take.items() for i, pid in enumerate(ids)]
    return [pid for _, _, pid in sorted(slots)]


def hdc(table: pd.DataFrame, n: int | None = None, *, easy_threshold: float = 0.9, seed: int = 0,
        **_: Any) -> list[str]:
    """Hierarchical Difficulty Curriculum: state scale is the slow (outer) axis, harness the fast
    (inner) one, so within each state scale the harness is weakened first, and only then does the
    state grow. Horizon breaks remaining ties (short first). Mastered problems (pass rate >=
    easy_threshold) are skipped: they would only repeat what the policy already does."""
    t = _prepared(table)
    for col in ("state", "harness"):
        if col not in t:
            raise ValueError(f"hdc needs a '{col}' column; build the table with apprentice.curriculum.pass_table")
    if "horizon" not in t:
        t["horizon"] = 0
    t = t[~(t["pass_rate"] >= easy_threshold)]
    keyed = sorted(t.itertuples(), key=lambda r: (r.state, r.harness, r.horizon, _tiebreak(r.problem_id, seed)))
    ids = [r.problem_id for r in keyed]
    return ids[:n] if n is not None else ids


def _abilities(v: Any) -> frozenset[str]:
    if isinstance(v, str):
        v = json.loads(v)
    return frozenset(str(a) for a in (v or []))


def aes(table: pd.DataFrame, n: int, *, p_star: float = 0.5, easy_threshold: float = 0.9, seed: int = 0,
        **_: Any) -> list[str]:
    """Ability-aware selection: greedy set cover over ``abilities``.

    Each pick is the problem adding the most abilities not yet covered in this round (ties: pass
    rate closest to p_star, then the seeded hash). When a round covers every ability present, a new
    round starts, so the first k picks span as many abilities as k problems can, instead of piling
    up the most common kind. Mastered problems are skipped unless nothing else is left."""
    t = _prepared(table)
    if "abilities" not in t:
        raise ValueError("aes needs an 'abilities' column; build the table with apprentice.curriculum.pass_table")
    live = t[~(t["pass_rate"] >= easy_threshold)]
    if live.empty:
        live = t
    cand = {r.problem_id: (_abilities(r.abilities), r.pass_rate) for r in live.itertuples()}
    universe = frozenset().union(*(a for a, _ in cand.values())) if cand else frozenset()
    covered: set[str] = set()
    out: list[str] = []
    while cand and len(out) < n:
        def score(pid: str, covered: set[str] = covered) -> tuple:
            abil, p = cand[pid]
            dist = abs(p - p_star) if not (isinstance(p, float) and math.isnan(p)) else 1.0
            return (-len(abil - covered), dist, _tiebreak(pid, seed))

        best = min(cand, key=score)
        out.append(best)
        covered |= cand.pop(best)[0]
        if covered >= universe:
            covered = set()
    return out


SAMPLERS: dict[str, Callable[..., list[str]]] = {"pass_band": pass_band, "dtac": dtac, "hdc": hdc, "aes": aes}

#: The ``curriculum.*`` settings a sampler reads (``curriculum.sampler`` picks which one): what
#: synthesis, whose sampler is ``synth.sampler``, fingerprints and depends on.
SAMPLER_SETTINGS = ("p_star", "band", "hard_threshold", "easy_threshold", "replay_share", "infeasible_share",
                    "min_attempts", "seed")


def sample(table: pd.DataFrame, n: int, cfg: Any) -> list[str]:
    """Dispatch on ``cfg.sampler`` (a :class:`apprentice.config.CurriculumConfig`) with its settings."""
    try:
        fn = SAMPLERS[cfg.sampler]
    except KeyError:
        raise ValueError(f"unknown curriculum.sampler '{cfg.sampler}'; choose from {sorted(SAMPLERS)}") from None
    kw = {k: getattr(cfg, k) for k in SAMPLER_SETTINGS}
    return fn(table, n, **kw)


def order_problems(problems: pd.DataFrame, table: pd.DataFrame, cfg: Any, n: int | None = None) -> pd.DataFrame:
    """The rows of a problems frame that ``cfg.sampler`` picks from ``table``, in its order (the RL
    training prompts, :func:`apprentice.curriculum.filter.keep_for_grpo`)."""
    ids = sample(table, n if n is not None else len(table), cfg)
    by_id = problems.set_index("problem_id", drop=False)
    missing = [i for i in ids if i not in by_id.index]
    if missing:
        raise ValueError(f"{len(missing)} sampled problem ids are not in the problems frame (e.g. {missing[0]}); "
                         "build the pass-rate table from rollouts of these problems")
    return by_id.loc[ids].reset_index(drop=True)


def keep_predicted(candidates: pd.DataFrame, predicted: Sequence[float], n: int,
                   cfg: Any) -> tuple[list[int], int, int]:
    """Which of the synthesis ``candidates`` (a problems frame, in generation order) to keep, from
    their *predicted* pass rates (``predicted[i]`` for row ``i``; the ex-ante difficulty predictor,
    no rollout): ``synth.sampler`` with the ``curriculum.*`` settings picks up to ``n``, topped up in
    generation order when it picks fewer (a narrow band). ``cfg`` is the whole config. Returns the
    kept row indices (sorted) and how many were picked and topped up."""
    ids = candidates["problem_id"].tolist()
    scale = 100  # predicted rate as successes out of 100 "attempts": the samplers' table, 1 % resolution
    rates = {pid: PassRate(round(float(p) * scale), scale) for pid, p in zip(ids, predicted, strict=True)}
    table = table_from_rates(rates, candidates)
    picked = sample(table, n, cfg.curriculum.model_copy(update={"sampler": cfg.synth.sampler}))
    chosen = set(picked[:n])
    order = [i for i, pid in enumerate(ids) if pid in chosen]
    topped = [i for i, pid in enumerate(ids) if pid not in chosen][: n - len(order)]
    return sorted(order + topped), len(order), len(topped)
