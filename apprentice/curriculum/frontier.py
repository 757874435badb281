"""The frontier controller: which levels the next iteration trains on, from the champion's pass rates.

Why: a loop that keeps training on the levels its champion already solves stops improving, and a
loop that trains where the champion never succeeds gives RL no signal (every group's rewards are
equal). Problems the current model solves about half the time carry the most learning signal: the
policy-gradient variance of a Bernoulli reward, p(1 - p), peaks at p = 0.5. Online difficulty
filtering keeps RL's problems in such a band ("Online Difficulty Filtering for Reasoning Oriented
Reinforcement Learning", arXiv 2504.03380); AdaRFT moves a target difficulty with the reward
("Efficient Reinforcement Finetuning via Adaptive Curriculum Learning", arXiv 2504.05520); WebRL grows
its task set from the agent's failures ("WebRL: Training LLM Web Agents via Self-Evolving Online
Curriculum Reinforcement Learning", arXiv 2411.02337). Reasoning Gym steps a level up above 0.70
recent success and down below 0.30. This module does the same per environment family, over the
families' integer levels, from a *probe* of the champion on fresh dev problems (never the benchmark).

Where it departs from those: the unit is a (family, level) cell, not a problem (the levels are the
generators' difficulty contract, so a level's pass rate predicts fresh problems of it), and the
decision is a *mix* for synthesis, not a filter: the teacher (or oracle) demonstrates every level,
so SFT can learn a level the champion does not solve yet; RL then draws from the band.

Everything here is a pure function over pass-rate tables, so the rules are tested without a model.
Per family, with the probe's rates ``r[L]`` and ``FrontierConfig`` (``target``, ``band``):

* the rates are first made **monotone** in level (:func:`monotone`, weighted isotonic regression): the
  generators' contract is that a level is no easier than the one below (``check-env`` checks it), so a
  lower level that probes below a higher one is probe noise (8 problems a cell), and pooling the two
  removes it. Without it, one failed probe episode on a solved level kept a family's mix on its easiest
  levels, below the level it was failing.

* **mastered**: ``r > target + band``; **band**: ``target - band <= r <= target + band``; **hard**:
  below the band.
* the **frontier window** ``[lo, hi]``: ``lo`` is the lowest level not mastered; ``hi`` the highest
  level at or above ``lo`` whose rate is in the band or above (``lo`` when none is). Hard levels inside
  the window stay in it (a measured dip between two band levels is noise or a harder axis step, and
  the teacher demonstrates it either way).
* **above**: the level after ``hi`` (``explore_share`` of the problems), so a level is demonstrated
  before the champion reaches it; **replay**: the mastered levels below ``lo`` (``replay_share``), so
  the climb does not forget them, none with more problems than a window level. A share with no level
  to go to goes to the window. Replay is large because a new level can teach a behaviour that
  contradicts the mastered ones (two hops where one was enough): a model trained mostly on the new
  level applies it everywhere (docs/experiments.md, "Replay keeps the mastered levels").
* the **ceiling** is the highest level planned; it rises as levels are mastered, and it never passes
  the family's top level (:meth:`apprentice.envs.base.Environment.top_level`): a family whose every
  level is mastered is *past its range* (recorded; evolution is where harder problems come from then).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

MASTERED, BAND, HARD = "mastered", "band", "hard"


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a pass rate (0, 1 when nothing was probed)."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


@dataclass(frozen=True)
class Cell:
    """The champion's probe on one (family, level): ``successes`` of ``n`` episodes."""

    family: str
    level: int
    n: int
    successes: int

    @property
    def rate(self) -> float:
        return self.successes / self.n if self.n else 0.0

    def record(self, target: float, band: float) -> dict[str, Any]:
        low, high = wilson(self.successes, self.n)
        return {**asdict(self), "rate": round(self.rate, 4), "low": round(low, 4), "high": round(high, 4),
                "status": status(self.rate, target, band)}


def status(rate: float, target: float, band: float) -> str:
    if rate > target + band:
        return MASTERED
    return BAND if rate >= target - band else HARD


def monotone(probe: Sequence[Cell]) -> dict[str, dict[int, float]]:
    """Family -> level -> pass rate, non-increasing in level: the weighted (by episodes) isotonic
    regression of the probe's rates (``scipy.optimize.isotonic_regression``, pool adjacent violators)."""
    from scipy.optimize import isotonic_regression

    out: dict[str, dict[int, float]] = {}
    for fam in sorted({c.family for c in probe}):
        row = sorted((c for c in probe if c.family == fam and c.n), key=lambda c: c.level)
        if not row:
            continue
        fit = isotonic_regression([c.rate for c in row], weights=[c.n for c in row], increasing=False).x
        out[fam] = {c.level: float(r) for c, r in zip(row, fit, strict=True)}
    return out


def cells(families: Iterable[str], levels: Iterable[int], successes: Iterable[bool | int | float]) -> list[Cell]:
    """Episode rows (family, level, success) -> one :class:`Cell` per (family, level), sorted."""
    tally: dict[tuple[str, int], list[int]] = {}
    for f, lv, ok in zip(families, levels, successes, strict=True):
        t = tally.setdefault((str(f), int(lv)), [0, 0])
        t[0] += 1
        t[1] += int(bool(ok))
    return [Cell(f, lv, n, k) for (f, lv), (n, k) in sorted(tally.items())]


@dataclass(frozen=True)
class Window:
    """One family's decision: the levels to train and why."""

    family: str
    lo: int
    hi: int
    above: tuple[int, ...]
    replay: tuple[int, ...]
    past_range: bool

    @property
    def ceiling(self) -> int:
        return max((self.hi, *self.above))

    @property
    def band_levels(self) -> tuple[int, ...]:
        return tuple(range(self.lo, self.hi + 1))


def window(family: str, rates: Mapping[int, float], top: int, target: float, band: float) -> Window:
    """The frontier window of one family from its probed ``rates`` (level -> pass rate; levels not
    probed count as hard: nobody has seen the champion solve them). ``top``: the family's top level."""
    levels = range(top + 1)
    mastered = [lv for lv in levels if status(rates.get(lv, 0.0), target, band) == MASTERED]
    lo = next((lv for lv in levels if lv not in mastered), top)
    past = len(mastered) == top + 1
    reach = [lv for lv in levels if lv >= lo and rates.get(lv, 0.0) >= target - band]
    hi = max(reach, default=lo)
    above = (hi + 1,) if hi < top else ()
    replay = tuple(lv for lv in mastered if lv < lo)
    return Window(family, lo, hi, above, replay, past)


def allocate(n: int, weights: Sequence[float]) -> list[int]:
    """``n`` items over ``weights`` in proportion, by largest remainder (ties to the earlier entry):
    the counts sum to ``n`` exactly and the same inputs give the same counts."""
    total = sum(weights)
    if n <= 0 or total <= 0:
        return [0] * len(weights)
    raw = [n * w / total for w in weights]
    out = [math.floor(x) for x in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - out[i]), i))
    for i in order[: n - sum(out)]:
        out[i] += 1
    return out


def mix(win: Window, n: int, replay_share: float, explore_share: float) -> dict[int, int]:
    """Level -> problems for one family: ``replay_share`` over the replay levels, ``explore_share``
    over the level above, the rest over the window (each part split evenly over its levels). A replay
    level gets no more problems than a window level: replay keeps a mastered level, it does not train it
    (one mastered level below a three-level window would otherwise take the whole share)."""
    per_window_level = (1.0 - replay_share - explore_share) / len(win.band_levels)
    replay = min(replay_share, per_window_level * len(win.replay))  # no mastered level above a window level
    parts: list[tuple[tuple[int, ...], float]] = [(win.band_levels, 1.0 - replay_share - explore_share),
                                                  (win.replay, replay), (win.above, explore_share)]
    orphan = replay_share - replay  # a share with nowhere to go (or past the cap) goes to the window
    orphan += sum(share for lvls, share in parts[1:] if not lvls)
    parts[0] = (parts[0][0], parts[0][1] + orphan)
    levels: list[int] = []
    weights: list[float] = []
    for lvls, share in parts:
        for lv in lvls:
            levels.append(lv)
            weights.append(share / len(lvls))
    counts = allocate(n, weights)
    out: dict[int, int] = {}
    for lv, c in zip(levels, counts, strict=True):
        if c:
            out[lv] = out.get(lv, 0) + c
    return dict(sorted(out.items()))


def split_families(n: int, families: Sequence[str]) -> dict[str, int]:
    """``n`` problems over the families as evenly as possible (the earlier families get the remainder)."""
    return dict(zip(families, allocate(n, [1.0] * len(families)), strict=True))


def fixed_mix(families: Sequence[str], levels: Sequence[int], n: int) -> dict[str, dict[int, int]]:
    """The mix of fixed levels: problem ``i`` to family ``i % F`` at level ``levels[(i // F) % L]``
    (synthesis's historical round robin, kept exact so a fixed-levels run is reproducible)."""
    out: dict[str, dict[int, int]] = {f: {} for f in families}
    for i in range(n):
        f, lv = families[i % len(families)], levels[(i // len(families)) % len(levels)]
        out[f][lv] = out[f].get(lv, 0) + 1
    return {f: dict(sorted(m.items())) for f, m in out.items()}


def decide(probe: Sequence[Cell], families: Sequence[str], tops: Mapping[str, int], n: int, *, target: float,
           band: float, replay_share: float, explore_share: float) -> dict[str, Any]:
    """The next iteration's synthesis mix from the champion's probe: per family its window and its
    level -> count mix, and the probe's cells with their intervals and status (``frontier.json``)."""
    per_family = split_families(n, families)
    pooled = monotone(probe)
    out: dict[str, Any] = {"cells": [c.record(target, band) for c in probe], "families": {},
                           "rates": {f: {str(c.level): round(c.rate, 4) for c in probe if c.family == f}
                                     for f in families},
                           "monotone_rates": {f: {str(lv): round(r, 4) for lv, r in pooled.get(f, {}).items()}
                                              for f in families}}
    for f in families:
        rates = pooled.get(f, {})
        win = window(f, rates, tops[f], target, band)
        out["families"][f] = {"window": [win.lo, win.hi], "above": list(win.above), "replay": list(win.replay),
                              "ceiling": win.ceiling, "past_range": win.past_range,
                              "mix": {str(k): v for k, v in mix(win, per_family[f], replay_share, explore_share).items()}}
    return out


def probe_levels(top: int, previous_ceiling: int | None, above: int) -> list[int]:
    """Levels to probe: 0 to ``above`` past the previous ceiling (every level when there is none),
    capped at the family's top. Probing far above the ceiling would spend episodes the champion fails."""
    hi = top if previous_ceiling is None else min(top, previous_ceiling + above)
    return list(range(hi + 1))


def slots(mix_by_family: Mapping[str, Mapping[Any, int]]) -> list[tuple[str, int]]:
    """The (family, level) of each problem, families interleaved and each family's levels in order:
    the synthesis plan's slots (the same mix always gives the same order)."""
    queues = {f: [int(lv) for lv, c in sorted(m.items(), key=lambda kv: int(kv[0])) for _ in range(int(c))]
              for f, m in mix_by_family.items()}
    out: list[tuple[str, int]] = []
    while any(queues.values()):
        for f in mix_by_family:
            if queues[f]:
                out.append((f, queues[f].pop(0)))
    return out


def band_levels(record: Mapping[str, Any]) -> dict[str, list[int]]:
    """Family -> the window's levels from a ``frontier.json`` record (RL draws its problems there)."""
    return {f: list(range(int(d["window"][0]), int(d["window"][1]) + 1))
            for f, d in (record.get("families") or {}).items() if d.get("window")}
