"""Divergences between teacher and student next-token distributions, per token.

Conventions are TRL's (``beta`` of ``generalized_jsd_loss`` / ``DistillationConfig.beta``):
``beta = 0`` is the forward KL(teacher || student) (mode-covering), ``beta = 1`` the reverse
KL(student || teacher) (mode-seeking, what OPD usually means), anything in between the generalised
JSD with mixture ``m = (1 - beta) p_student + beta p_teacher``:
``JSD_beta = beta KL(teacher || m) + (1 - beta) KL(student || m)``.

Two entry points, both TRL's code:
  * :func:`per_token_divergence` on full logits: TRL's ``GKDTrainer.generalized_jsd_loss`` with
    ``reduction="none"``, summed over the vocabulary (tests check it against hand-computed values).
  * :func:`chunked_per_token_divergence` on hidden states + LM heads: TRL's ``ChunkedDivergenceFunction``,
    the kernel ``DistillationTrainer`` trains with, which never materialises ``[N, V]`` logits. We call
    it directly (instead of ``_chunked_divergence_loss``) because that wrapper returns only the sum, and
    turn weighting / SOD need the per-token values; the kernel's backward scales each token's gradient
    by its upstream weight, so a weighted sum is exact.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

Divergence = Literal["forward_kl", "reverse_kl", "jsd"]


def beta_for(divergence: Divergence, beta: float = 0.5) -> float:
    """``divergence`` + the JSD ``beta`` -> TRL's single ``beta``."""
    if divergence == "forward_kl":
        return 0.0
    if divergence == "reverse_kl":
        return 1.0
    if divergence == "jsd":
        if not 0.0 < beta < 1.0:
            raise ValueError(f"jsd needs 0 < beta < 1 (got {beta}); use divergence=forward_kl/reverse_kl for 0/1")
        return float(beta)
    raise ValueError(f"unknown divergence {divergence!r}; use forward_kl, reverse_kl or jsd")


@functools.cache
def _trl_gjsd():
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.gkd import GKDTrainer

    return GKDTrainer.generalized_jsd_loss


def per_token_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
                         temperature: float = 1.0) -> torch.Tensor:
    """``[..., V]`` logits -> ``[...]`` divergence per position (TRL's generalized JSD, not reduced)."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ; the models must share the vocabulary")
    per_vocab = _trl_gjsd()(student_logits, teacher_logits, beta=beta, temperature=temperature, reduction="none")
    return per_vocab.sum(-1)


def chunked_per_token_divergence(student_hidden: torch.Tensor, student_head: torch.nn.Module,
                                 teacher_hidden: torch.Tensor, teacher_head: torch.nn.Module, beta: float,
                                 temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, H]`` hidden states of the selected positions -> (divergence ``[N]``, student entropy ``[N]``)."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    return ChunkedDivergenceFunction.apply(
        student_hidden, student_head.weight, getattr(student_head, "bias", None),
        teacher_hidden, teacher_head.weight, getattr(teacher_head, "bias", None),
        float(beta), float(temperature), 1.0, None, 1.0, None,
    )


def weighted_sum(per_token: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The loss: ``sum_i w_i d_i`` (weights from :mod:`apprentice.training.opd.weighting` sum to 1)."""
    return (per_token * weights.to(per_token.dtype)).sum()
