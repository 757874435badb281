"""Stage ``evaluate-all`` (the ``evaluate`` step of the pipeline): every model of iteration k on the
held-out problems, in one process.

Why not one ``python -m apprentice evaluate --policy X`` per model: each process pays the torch +
transformers import (5-7 s idle, far more on a busy 2-core box) before evaluating a tiny model for
less than that. This loops :func:`apprentice.stages.evaluate.run` over ``POLICIES`` and writes the
same files (``data/iter_k/eval/<policy>.parquet|json``).
"""

from __future__ import annotations

from typing import Any

from apprentice.config import Config
from apprentice.paths import Paths

#: The evaluation table of an iteration: where it started (base) and each training stage's model.
POLICIES = ("base", "sft", "rl", "student")


def run(cfg: Config, paths: Paths, **_: Any) -> dict[str, Any]:
    from apprentice.stages import evaluate  # lazily: dvcgen imports POLICIES without torch

    results = {p: evaluate.run(cfg, paths, policy=p) for p in POLICIES}
    return {p: {"success_rate": r["success_rate"], "success_ci": r["success_ci"]} for p, r in results.items()}
