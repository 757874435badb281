"""On-policy distillation family (issue C): executor policies, divergences, weighting, annealing,
privileged self-distillation, and the multi-turn mixed-rollout trainer. See docs/experiments.md §C.

``VARIANTS`` (name -> ``cfg -> Recipe``) is the registry ``distill.variant`` selects from;
``train_variant`` builds the trainer for the configured variant (imports TRL lazily).
"""

from apprentice.training.opd.variants import VARIANTS, Recipe, recipe_for

__all__ = ["VARIANTS", "Recipe", "recipe_for"]
