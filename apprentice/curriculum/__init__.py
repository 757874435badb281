"""Curriculum: which problems the pipeline spends rollouts and gradient steps on.

Each decision has one entry point, and the stages call only these:

* which synthesis candidates are kept (from predicted pass rates): :func:`keep_predicted` (``samplers``);
* in what order RL reads its problems, and which of them the probe covers: :func:`probe_plan` (``order``);
* which evolved generation joins the RL pool: :func:`feed_generations` (``schedule``);
* which probed problems GRPO trains on, and in what order: :func:`keep_for_grpo` (``filter``);
* which problems fit GRPO's episode budget at all: :func:`within_budget` (``budget``);
* which levels the next iteration synthesizes, from the champion's probe: :mod:`frontier`
  (:func:`frontier.decide`).

They all read the policy's pass rates in one shape, :data:`PassRates` (``{problem_id:
PassRate(successes, samples)}``, ``table``); the samplers' wider pandas frame is built from it
inside the package. The rules come from papers that ship no reusable library (environment evolution
and its generation schedule; the pass-rate band, DTAC, HDC and AES samplers; pass-rate calibration),
so they are small pure functions over tables, tested on synthetic ones. The evolution
operators that *make* harder generations stay with the environments (:mod:`apprentice.envs.evolve`).
"""

from __future__ import annotations

from apprentice.curriculum import budget, frontier
from apprentice.curriculum.budget import Need, within_budget
from apprentice.curriculum.filter import (
    band_first,
    filter_summary,
    informative,
    keep_for_grpo,
    pass_rate_filter,
)
from apprentice.curriculum.order import difficulty_key, order_by_difficulty, probe_plan, spread
from apprentice.curriculum.samplers import (
    SAMPLER_SETTINGS,
    SAMPLERS,
    aes,
    dtac,
    hdc,
    keep_predicted,
    order_problems,
    pass_band,
    sample,
)
from apprentice.curriculum.schedule import GenerationScheduler, feed_generations
from apprentice.curriculum.table import PassRate, PassRates, pass_rates, pass_table, table_from_rates

__all__ = [
    # the entry points, one per decision
    "budget", "feed_generations", "frontier", "keep_for_grpo", "within_budget", "keep_predicted", "probe_plan",
    # the pass-rate table
    "Need", "PassRate", "PassRates", "pass_rates", "pass_table", "table_from_rates",
    # the rules behind the entry points (tests, bench/)
    "SAMPLERS", "SAMPLER_SETTINGS", "GenerationScheduler", "aes", "band_first", "difficulty_key", "dtac",
    "filter_summary", "hdc", "informative", "order_by_difficulty", "order_problems", "pass_band",
    "pass_rate_filter", "sample", "spread",
]
