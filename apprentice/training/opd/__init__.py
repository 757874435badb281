"""On-policy distillation family: executor policies, divergences, weighting, annealing, privileged
self-distillation, and the multi-turn mixed-rollout trainer (results in docs/experiments.md).

``VARIANTS`` (name -> ``cfg -> Recipe``) is the one registry ``distill.variant`` selects from, the
single-turn default included; :func:`apprentice.training.distill.make_trainer` builds the trainer the
configured variant's recipe names (TRL is imported only there).
"""

from apprentice.training.opd.variants import VARIANTS, Recipe, recipe_for

__all__ = ["VARIANTS", "Recipe", "recipe_for"]
