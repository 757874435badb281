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

* **A shared prefix encoded once** (:func:`share_prefix`, :class:`PrefixGroupedSampler`). Episodes of
  one environment family open with the same system prompt and tool schemas: on the default SFT set,
  171 of a conversation's ~500 tokens. The sampler puts conversations of one family into the same
  micro-batch (random order otherwise), and :func:`share_prefix` keeps that common prefix once in
  the flattened row: every later conversation's segment attends to it (:func:`sdpa_varlen_forward`
  with ``shared_prefix``), its tokens at their true positions. The gradient through the prefix is the
  sum over the conversations that read it, as before. Measured: README § Benchmarks.

Why hand-written: flash-attention's varlen kernels need a GPU and TRL's compact fused head is
Triton-only; what is left for CPU is a loop over ``sdpa`` calls and a gather before the head. No
library trains several sequences over one copy of their common prefix (vLLM and SGLang share it in
inference only), nor samples micro-batches by a group key (transformers' ``group_by_length`` sorts
by length, which orders a run family by family).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Sampler

VARLEN = "sdpa_varlen"
SHARED_PREFIX = "shared_prefix"  # forward kwarg: length of segment 0, which every later segment attends to
MIN_SHARED_PREFIX = 16  # tokens; a shorter common prefix is not worth changing the batch for


def sdpa_varlen_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``sdpa`` per packed sequence when the batch is one flattened row with ``cu_seq_lens_q``.

    With ``shared_prefix`` = P (:func:`share_prefix`), segment 0 is the first P tokens and every segment
    that starts at or after P is a conversation's continuation of them: it attends to the prefix's
    keys, then causally to its own."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.pop("cu_seq_lens_q", None)
    kwargs.pop("cu_seq_lens_k", None)
    packed = cu is not None and query.shape[0] == 1 and query.shape[2] == key.shape[2] and query.shape[2] > 1
    if not packed:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    prefix = int(kwargs.pop(SHARED_PREFIX, 0) or 0)
    bounds = cu.tolist() if isinstance(cu, torch.Tensor) else list(cu)
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        if e <= s:
            continue
        if prefix and s >= prefix:  # a later conversation's own tokens: the shared prefix, then causal
            k = torch.cat([key[:, :, :prefix], key[:, :, s:e]], dim=2)
            v = torch.cat([value[:, :, :prefix], value[:, :, s:e]], dim=2)
            mask = torch.ones(e - s, prefix + e - s, dtype=torch.bool, device=query.device)
            mask[:, prefix:] = torch.ones(e - s, e - s, dtype=torch.bool, device=query.device).tril()
            out, _ = sdpa_attention_forward(module, query[:, :, s:e], k, v, mask[None, None], dropout=dropout,
                                            scaling=scaling, is_causal=False, **kwargs)
        else:
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


def share_prefix(inputs: dict[str, Any], min_prefix: int = MIN_SHARED_PREFIX) -> tuple[dict[str, Any], int]:
    """A flattened batch with its conversations' common prefix kept once; returns ``(inputs, P)``.

    The first conversation stays whole; each later one loses its first P tokens, which equal the
    first conversation's, and its remaining tokens keep their positions (P, P+1, ...). The new
    ``cu_seq_lens`` mark the prefix as segment 0, so :func:`sdpa_varlen_forward` lets each
    continuation attend to it. P stops before any later conversation's first supervised token: the
    token after the prefix is predicted from the hidden state of the token before it, which in the new
    row belongs to another segment, so that target must carry no loss. Unchanged (P = 0) when the
    batch is not flattened, has one conversation, or shares fewer than ``min_prefix`` tokens.
    """
    cu = inputs.get("cu_seq_lens_q")
    ids = inputs["input_ids"]
    if cu is None or ids.shape[0] != 1 or SHARED_PREFIX in inputs:
        return inputs, 0
    bounds = cu.tolist() if isinstance(cu, torch.Tensor) else list(cu)
    seqs = [(s, e) for s, e in zip(bounds[:-1], bounds[1:], strict=True) if e > s]
    if len(seqs) < 2:
        return inputs, 0
    row, labels = ids[0], inputs["labels"][0]
    s0, e0 = seqs[0]
    shared = e0 - s0
    for s, e in seqs[1:]:
        n = min(shared, e - s)
        differ = (row[s:s + n] != row[s0:s0 + n]).nonzero()
        shared = int(differ[0]) if len(differ) else n
        supervised = (labels[s:e] != -100).nonzero()
        shared = min(shared, (int(supervised[0]) if len(supervised) else e - s) - 1)
    if shared < min_prefix:
        return inputs, 0
    keep = torch.cat([torch.arange(s0, e0)] + [torch.arange(s + shared, e) for s, e in seqs[1:]])
    lens = [shared, e0 - s0 - shared] + [e - s - shared for s, e in seqs[1:]]
    cu_new = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    out = dict(inputs)
    for name in ("input_ids", "labels", "position_ids"):
        if name in inputs:
            out[name] = inputs[name][:, keep]
    out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = cu_new
    out["max_length_q"] = out["max_length_k"] = max(lens)
    out.pop("seq_idx", None)  # linear-attention layers only; their segments are not prefix-aware
    out[SHARED_PREFIX] = shared
    return out, shared


class PrefixGroupedSampler(Sampler[int]):
    """A random order in which consecutive runs of ``batch_size`` indices share a group (a prefix).

    Each epoch: shuffle, cut every group into full micro-batches, put what is left of the groups into
    mixed micro-batches, then shuffle the micro-batches (a short last one stays last, so the batches the
    DataLoader cuts are exactly these). Seeded by ``seed`` + epoch, nothing global: a run resumed
    mid-epoch skips into the same order.
    """

    def __init__(self, groups: Sequence[Hashable], batch_size: int, seed: int) -> None:
        self.groups, self.batch_size, self.seed, self.epoch = list(groups), max(int(batch_size), 1), int(seed), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.groups)

    def batches(self) -> list[list[int]]:
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        by: dict[Hashable, list[int]] = {}
        for i in torch.randperm(len(self.groups), generator=gen).tolist():
            by.setdefault(self.groups[i], []).append(i)
        bs, full, rest = self.batch_size, [], []
        for members in by.values():
            cut = len(members) // bs * bs
            full += [members[j:j + bs] for j in range(0, cut, bs)]
            rest += members[cut:]
        full += [rest[j:j + bs] for j in range(0, len(rest) - len(rest) % bs, bs)]
        order = [full[j] for j in torch.randperm(len(full), generator=gen).tolist()]
        return order + ([rest[len(rest) - len(rest) % bs:]] if len(rest) % bs else [])

    def __iter__(self) -> Iterator[int]:
        return iter([i for batch in self.batches() for i in batch])
