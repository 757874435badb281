"""Per-token loss weights for distillation: token-level vs turn-balanced, and step re-weighting by
divergence (SOD).

Why hand-written: a few lines of tensor code over TRL's per-token divergences; no library has them.
Why an ablation axis: the literature disagrees on whether high-divergence steps deserve *less*
weight (SOD, "SOD: Step-wise On-policy Distillation for Small Language Model Agents",
arXiv:2605.07725: the teacher is unreliable there) or *more* (T-DUR of ATOD, arXiv:2606.27814: they
are the informative turns). One signed knob covers both: ``sod_alpha > 0`` attenuates, ``< 0``
amplifies, ``0`` is off.

All functions take flat tensors over the loss positions of a batch: ``turn_ids[i]`` names the turn
(unique over the batch) that token ``i`` belongs to. Weights are detached and sum to 1, so the loss
is a weighted mean and its scale does not change with the weighting mode.
"""

from __future__ import annotations

from typing import Literal

import torch

Mode = Literal["token", "turn"]


def base_weights(turn_ids: torch.Tensor, mode: Mode = "token") -> torch.Tensor:
    """``token``: every token counts the same (long turns dominate). ``turn``: every turn gets the same
    total weight, split evenly over its tokens (the turn-balanced loss of "TurnOPD: Making On-Policy
    Distillation Turn-Aware for Efficient Long-Horizon Agent Training", arXiv:2607.05804)."""
    n = turn_ids.numel()
    if n == 0:
        return torch.zeros(0)
    if mode == "token":
        return torch.full((n,), 1.0 / n)
    if mode == "turn":
        _, inverse, counts = torch.unique(turn_ids, return_inverse=True, return_counts=True)
        return 1.0 / (counts[inverse].float() * counts.numel())
    raise ValueError(f"unknown weighting {mode!r}; use token or turn")


def turn_means(values: torch.Tensor, turn_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of ``values`` per turn: (means over unique turns, index of each token's turn)."""
    uniq, inverse = torch.unique(turn_ids, return_inverse=True)
    sums = torch.zeros(uniq.numel(), dtype=torch.float32).index_add_(0, inverse, values.detach().float().cpu())
    counts = torch.bincount(inverse, minlength=uniq.numel()).float()
    return sums / counts, inverse


def sod_multipliers(divergence: torch.Tensor, turn_ids: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per-token multipliers ``exp(-alpha * d_k / mean_k d_k)`` from each turn's mean divergence ``d_k``.

    Relative to the batch mean, so ``alpha`` does not depend on the divergence's scale; detached.
    """
    if alpha == 0.0 or divergence.numel() == 0:
        return torch.ones(divergence.numel())
    d_turn, inverse = turn_means(divergence, turn_ids.cpu())
    ref = d_turn.mean().clamp_min(1e-8)
    return torch.exp(-alpha * d_turn / ref)[inverse]


def loss_weights(turn_ids: torch.Tensor, divergence: torch.Tensor | None = None, mode: Mode = "token",
                 sod_alpha: float = 0.0) -> torch.Tensor:
    """Final per-token weights (sum 1, detached, on ``turn_ids``' device)."""
    w = base_weights(turn_ids.cpu(), mode)
    if sod_alpha != 0.0:
        if divergence is None:
            raise ValueError("SOD re-weighting needs the per-token divergence")
        w = w * sod_multipliers(divergence, turn_ids, sod_alpha)
    total = w.sum()
    if total > 0:
        w = w / total
    return w.to(turn_ids.device)
