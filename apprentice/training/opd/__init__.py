"""On-policy distillation family (issue C): executor policies, divergences, weighting, annealing,
privileged self-distillation, and the multi-turn mixed-rollout trainer. See docs/experiments.md §C."""
