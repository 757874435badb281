"""Trainers: SFT, curriculum GRPO, distillation and on-policy distillation, each wrapping TRL."""
