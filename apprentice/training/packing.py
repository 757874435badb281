"""Padding-free SFT batches on CPU: per-sequence causal attention over a flattened batch, loss-only LM head.

Why: on this 2-core fp32 CPU an SFT step is compute-bound, and raw TRL spends a large share of it
on tokens that teach nothing. Measured on the default profile's SFT set (``bench/train_throughput.py``
prints the audit): a right-padded batch of 4 conversations is ~30 % padding, and only ~27 % of the
real tokens carry loss (the assistant turns), yet TRL's fused LM head scores *every* position on
non-Triton devices (``trl.trainer.utils.add_fused_lm_head``: ``compact = _use_triton(device)``), so
the 49k-vocabulary projection runs on ~4x more positions than the loss reads.

Two fixes, both exact (same loss where the data is the same, up to float summation order):

* **Padding-free batches, attention per sequence.** TRL's collator with ``padding_free=True``
  concatenates the batch into one row and passes ``cu_seq_lens_q/k`` (sequence boundaries).
  Transformers' ``sdpa`` then attends through a block-diagonal (T x T) mask over the whole row,
  which on CPU costs *more* attention FLOPs than the padding it removes (4 x 500 tokens -> one
  2000 x 2000 score matrix instead of four 700 x 700 ones). ``sdpa_varlen`` (registered through the
  public ``AttentionInterface``) runs causal SDPA on each sequence's slice instead: no padding, no
  cross-sequence work, the flash CPU kernel (``is_causal``) per sequence. Without ``cu_seq_lens``
  (generation, evaluation) it is plain ``sdpa``.
* **LM head on loss positions only** (:func:`compact_nll`): the backbone's last hidden states are
  gathered at the positions whose next-token label is supervised, and only those go through the
  head and the log-softmax.

Why hand-written: flash-attention's varlen kernels need a GPU and TRL's compact fused head is
Triton-only; what is left for CPU is a loop over ``sdpa`` calls and a gather before the head.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

VARLEN = "sdpa_varlen"


def sdpa_varlen_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``sdpa`` per packed sequence when the batch is one flattened row with ``cu_seq_lens_q``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.pop("cu_seq_lens_q", None)
    kwargs.pop("cu_seq_lens_k", None)
    packed = cu is not None and query.shape[0] == 1 and query.shape[2] == key.shape[2] and query.shape[2] > 1
    if not packed:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    bounds = cu.tolist() if isinstance(cu, torch.Tensor) else list(cu)
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        if e <= s:
            continue
        out, _ = sdpa_attention_forward(module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], None,
                                        dropout=dropout, scaling=scaling, is_causal=True, **kwargs)
        outs.append(out)  # (1, len, heads, head_dim)
    return torch.cat(outs, dim=1), None


def register() -> str:
    """Register ``sdpa_varlen`` (attention + its mask builder, the same as ``sdpa``'s); idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(VARLEN, sdpa_varlen_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN, sdpa_mask)
    return VARLEN


def use_varlen(model: Any) -> str:
    """Switch ``model`` to ``sdpa_varlen``; returns the implementation to restore before saving."""
    register()
    before = model.config._attn_implementation
    if before in ("sdpa", VARLEN):
        model.set_attn_implementation(VARLEN)
    return "sdpa" if before == VARLEN else before


def compact_nll(model: Any, inputs: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Summed next-token NLL over supervised positions, with the head run on those positions only.

    Returns ``(nll_sum, stats)`` where ``stats`` holds ``n`` (supervised tokens), ``entropy_sum``
    and ``correct`` (top-1 hits), the numbers TRL logs as ``entropy`` and ``mean_token_accuracy``.
    """
    labels = inputs["labels"]
    fwd = {k: v for k, v in inputs.items() if k != "labels"}
    fwd["use_cache"] = False
    core = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT: the wrapped LM
    backbone = getattr(core, core.base_model_prefix)
    hidden = backbone(**fwd).last_hidden_state[:, :-1]
    target = labels[:, 1:]
    mask = target != -100
    h = hidden[mask]
    logits = core.get_output_embeddings()(h).float()
    logp = torch.log_softmax(logits, dim=-1)
    tgt = target[mask]
    nll = F.nll_loss(logp, tgt, reduction="sum")
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1).sum()
        correct = (logits.argmax(-1) == tgt).sum()
    return nll, {"n": mask.sum(), "entropy_sum": entropy, "correct": correct}
