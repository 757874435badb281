"""Which probed problems GRPO trains on, and in what order: the pass-rate filter (or a sampler).

* :func:`pass_rate_filter`: GRPO's advantage is reward minus the group mean, so a problem the
  policy always solves (pass rate 1) or never solves (pass rate 0) gives every sample the same
  reward and a zero gradient: the pass-rate calibration DTAC (EvoCUA-1.5) applies. Dropping them
  spends the few RL steps we can afford where they can move the policy.
* :func:`band_first`: the probed, informative problems lead, then the unprobed ones by how close
  their stratum's probed pass rate is to 0.5.
* ``rl.curriculum: sampler`` hands the choice to ``curriculum.sampler`` instead
  (:mod:`apprentice.curriculum.samplers`: pass_band, dtac, hdc, aes).

:func:`keep_for_grpo` is the entry point the RL stage calls. Pure functions over
:data:`~apprentice.curriculum.table.PassRates`, so they are unit-testable without a model.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import pandas as pd

from apprentice.curriculum.samplers import order_problems
from apprentice.curriculum.table import PassRate, PassRates, table_from_rates

__all__ = ["band_first", "filter_summary", "informative", "keep_for_grpo", "pass_rate_filter"]


def informative(rate: PassRate) -> bool:
    """A problem carries GRPO signal iff the probe saw both a success and a failure."""
    return 0 < rate.successes < rate.samples


def pass_rate_filter(ordered_ids: list[str], table: PassRates) -> list[str]:
    """Keep the problems of ``ordered_ids`` (curriculum order preserved) that are worth training on.

    * probed with 0 < pass rate < 1: kept;
    * probed with pass rate 0 or 1: dropped (no within-group reward variance);
    * not probed (beyond the probe budget): kept, since nothing is known against them.

    If every problem was probed and none is informative, the filter would leave nothing to train
    on; it then falls back to the unfiltered order with a warning (training on a constant-reward
    group is a no-op, not an error).
    """
    kept = [pid for pid in ordered_ids if pid not in table or informative(table[pid])]
    if not kept and ordered_ids:
        warnings.warn(
            "pass-rate filter: every probed problem was always or never solved by the current policy; "
            "training on the unfiltered curriculum (expect ~zero GRPO gradient). Probe more problems "
            "(rl.probe_problems) or add harder/easier levels (synth.levels).",
            stacklevel=2,
        )
        return list(ordered_ids)
    return kept


def band_first(kept: list[str], table: PassRates,
               strata: Mapping[str, Any] | None = None) -> list[str]:
    """``kept`` with the probed, informative problems first, then the unprobed ones whose stratum
    (e.g. (family, level)) the probe found closest to a 0.5 pass rate; curriculum order within ties.

    GRPO reads the dataset in order and takes only ``max_steps x prompts_per_step`` prompts on CPU;
    unprobed problems interleaved by difficulty would otherwise come first and, being mostly easy,
    give constant-reward groups (zero gradient). A probe sees a few problems per stratum; their
    pooled pass rate is the best cheap guess of where an unprobed problem's group will vary."""
    band = [p for p in kept if p in table and informative(table[p])]
    rest = [p for p in kept if p not in set(band)]
    if strata:
        pooled: dict[Any, list[int]] = {}
        for pid, r in table.items():
            if pid in strata:
                c = pooled.setdefault(strata[pid], [0, 0])
                c[0], c[1] = c[0] + r.successes, c[1] + r.samples
        def distance(pid: str) -> float:
            c = pooled.get(strata.get(pid))
            return abs(c[0] / c[1] - 0.5) if c and c[1] and pid not in table else 1.0
        rest = sorted(rest, key=distance)  # stable: curriculum order within equal distances
    return band + rest


def filter_summary(ordered_ids: list[str], table: PassRates, kept: list[str]) -> dict[str, Any]:
    probed = [pid for pid in ordered_ids if pid in table]
    return {
        "candidates": len(ordered_ids),
        "probed": len(probed),
        "always_solved": sum(1 for p in probed if table[p].samples and table[p].successes == table[p].samples),
        "never_solved": sum(1 for p in probed if table[p].successes == 0),
        "kept": len(kept),
        "mean_probe_pass_rate": (sum(table[p].rate for p in probed) / len(probed)) if probed else None,
    }


def keep_for_grpo(ordered: pd.DataFrame, probed: pd.DataFrame, rates: PassRates,
                  cfg: Any) -> tuple[pd.DataFrame, dict[str, Any]]:
    """The rows GRPO trains on, in the order it reads them, and a summary for ``curriculum.json``.

    ``ordered``: the candidates in curriculum order (:func:`~apprentice.curriculum.order.probe_plan`,
    plus any fed generation); ``probed``: the rows the probe measured; ``rates``: their pass rates;
    ``cfg``: the whole config (``rl.curriculum`` and ``curriculum.*``). With ``rl.curriculum: sampler``
    the sampler picks from the probed rows (falling back, with a warning, to the whole order when it
    picks none); otherwise the pass-rate filter, band first, over the whole order."""
    ids = ordered["problem_id"].tolist()
    if cfg.rl.curriculum == "sampler":  # the samplers (pass_band, dtac, hdc, aes) pick from the probe
        picked = order_problems(probed, table_from_rates(rates, probed), cfg.curriculum)
        if picked.empty:  # nothing the sampler accepts (a policy that solves nothing): the filter's fallback
            warnings.warn(f"curriculum sampler '{cfg.curriculum.sampler}' picked none of the {len(probed)} probed "
                          "problems; training on the unfiltered order (expect ~zero GRPO gradient). Probe more "
                          "problems (rl.probe_problems) or widen the band (curriculum.band).", stacklevel=3)
            picked = ordered
        summary = filter_summary(ids, rates, picked["problem_id"].tolist())
        return picked, {**summary, "sampler": cfg.curriculum.sampler}
    strata = {r["problem_id"]: (r["family"], int(r["level"])) for r in ordered.to_dict("records")}
    kept = band_first(pass_rate_filter(ids, rates), rates, strata)
    summary = filter_summary(ids, rates, kept)
    by_id = ordered.set_index("problem_id", drop=False)
    return by_id.loc[kept].reset_index(drop=True), summary
