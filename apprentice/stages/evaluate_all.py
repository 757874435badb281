"""``python -m apprentice evaluate-all``: every model of iteration k on the held-out problems, in one
process (by hand: one torch + transformers import instead of four, each of which costs seconds).

The pipeline does not use it: ``dvc.yaml`` has one DVC stage per model (``evaluate-k@<model>``,
:func:`apprentice.ops.dvcgen.dvc_stages`, the registry's ``models``), so DVC re-evaluates only the models that changed (an RL
experiment does not re-evaluate base and SFT). Both write the same files
(``data/iter_k/eval/<policy>.parquet|json``) through :func:`apprentice.stages.evaluate.run`.
"""

from __future__ import annotations

from typing import Any

from apprentice.config import Config
from apprentice.paths import Paths
from apprentice.pipeline import EVAL_POLICIES

#: The evaluation table of an iteration: where it started (base) and each training stage's model.
POLICIES = EVAL_POLICIES


def run(cfg: Config, paths: Paths, **_: Any) -> dict[str, Any]:
    from apprentice.stages import evaluate  # lazily: importing this module must not load torch

    results = {p: evaluate.run(cfg, paths, policy=p) for p in POLICIES}
    return {p: {"success_rate": r["success_rate"], "success_ci": r["success_ci"]} for p, r in results.items()}
