"""ATOD-style annealing between the OPD loss and a GRPO policy-gradient loss.

OPD is dense and fast early but saturates at the teacher; RL is sparse and slow early but has the
higher ceiling ("ATOD: Annealed Turn-aware On-policy Distillation for Multi-turn Autonomous Agents",
arXiv:2606.27814, anneals from one to the other). The mixer gives ``w_opd`` decaying from
``opd_start`` to ``opd_end`` and ``w_rl`` rising from ``rl_start`` to ``rl_end`` on the same schedule
shape, so "OPD high early, RL rising" is one object the trainer asks each step.

The RL term is GRPO's: group-relative advantages ``A = (r - mean_group) / (std_group + eps)`` over the
episodes of the same problem, and the on-policy surrogate ``-A * log pi(token)`` averaged over the
student's tokens. With one optimisation pass per rollout (TRL's ``num_iterations=1``) and ``beta=0``
the importance ratio is 1 and the clip is inactive, so this is exactly the gradient GRPOTrainer
computes; it is written out here only because the annealed sum needs both terms in one backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from apprentice.training.opd.schedules import DecayKind, decay_factor, progress


@dataclass(frozen=True)
class ObjectiveMixer:
    total_steps: int
    opd_start: float = 1.0
    opd_end: float = 0.0
    rl_start: float = 0.0
    rl_end: float = 1.0
    kind: DecayKind = "linear"

    def weights(self, step: int) -> tuple[float, float]:
        """(w_opd, w_rl) at ``step``; the end points are exact."""
        f = decay_factor(self.kind, progress(step, self.total_steps))
        w_opd = self.opd_end + (self.opd_start - self.opd_end) * f
        w_rl = self.rl_end + (self.rl_start - self.rl_end) * f
        return w_opd, w_rl


OPD_ONLY = ObjectiveMixer(total_steps=1, opd_start=1.0, opd_end=1.0, rl_start=0.0, rl_end=0.0, kind="constant")
RL_ONLY = ObjectiveMixer(total_steps=1, opd_start=0.0, opd_end=0.0, rl_start=1.0, rl_end=1.0, kind="constant")


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """GRPO's advantages as TRL's ``GRPOTrainer`` computes them (``scale_rewards="group"``): reward minus
    its group mean, divided by the group's *sample* std (Bessel-corrected, TRL's ``nanstd``) + 1e-4.
    For rewards [1, 0] that is +-0.707, not +-1. A group whose rewards are all equal gets advantage 0
    (no signal), as in GRPO; a group of one (no std defined) also gets 0."""
    rewards = rewards.float()
    out = torch.zeros_like(rewards)
    for g in torch.unique(group_ids):
        sel = group_ids == g
        r = rewards[sel]
        std = r.std(unbiased=True) if r.numel() > 1 else torch.tensor(0.0)
        out[sel] = (r - r.mean()) / (std + eps)
    return out


def token_share(n_tokens: int | torch.Tensor, num_items_in_batch: int | torch.Tensor | None) -> float | torch.Tensor:
    """Factor turning a per-micro-batch token *mean* into TRL's normalisation: the micro-batch's token sum
    divided by ``num_items_in_batch`` (the loss tokens of the whole accumulation window, all processes,
    as TRL's ``DistillationTrainer`` passes it). Summed over the window's micro-batches that is the mean
    over every token of the window, whatever the grad-accumulation steps and micro-batch sizes; without
    ``num_items_in_batch`` (evaluation) the micro-batch mean stays (factor 1)."""
    if num_items_in_batch is None:
        return 1.0
    return n_tokens / (num_items_in_batch.clamp(min=1) if isinstance(num_items_in_batch, torch.Tensor)
                       else max(float(num_items_in_batch), 1.0))


def policy_gradient_loss(token_logps: torch.Tensor, token_advantages: torch.Tensor) -> torch.Tensor:
    """``-mean(A * log pi)`` over the given tokens (ratio-1 GRPO surrogate; see module docstring)."""
    if token_logps.numel() == 0:
        return token_logps.sum()
    return -(token_advantages.to(token_logps.dtype) * token_logps).mean()
