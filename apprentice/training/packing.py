"""Padding-free training batches on CPU: per-sequence causal attention over a flattened batch, loss-only LM head,
a common prefix encoded once (SFT's micro-batches of one family, GRPO's group of one prompt).

Why: on CPU a training step is compute-bound, and raw TRL spends much of it on tokens that teach
nothing: a right-padded batch of conversations is partly padding, only the assistant turns carry
loss, yet TRL's fused LM head scores *every* position on non-Triton devices
(``trl.trainer.utils.add_fused_lm_head``: ``compact = _use_triton(device)``), so the vocabulary
projection runs on several times more positions than the loss reads (``bench/train_throughput.py``
prints the audit). The fixes below are exact (same loss on the same data, up to float summation order):

* **Padding-free batches, attention per sequence.** TRL's collator with ``padding_free=True``
  concatenates the batch into one row and passes ``cu_seq_lens_q/k`` (sequence boundaries), and
  transformers' ``sdpa`` then attends through a block-diagonal mask over the whole row: n sequences
  of length L cost one (nL)^2 score matrix instead of n L^2, more attention FLOPs than the padding
  removed. ``sdpa_varlen`` (registered through the public ``AttentionInterface``) runs causal SDPA
  on each sequence's slice (the flash CPU kernel, ``is_causal``); without ``cu_seq_lens``
  (generation, evaluation) it is plain ``sdpa``.
* **LM head on loss positions only** (:func:`compact_nll`): the head and the log-softmax run on the
  hidden states of the positions whose next-token label is supervised.
* **A shared prefix encoded once** (:func:`share_prefix`, :class:`PrefixGroupedSampler`): episodes
  of one environment open with the same system prompt and tool schemas, a large share of a short
  conversation. The sampler puts conversations of one environment into the same micro-batch, and the
  flattened row keeps that prefix once; every later segment attends to it (``shared_prefix``) at its
  true positions, and the prefix's gradient is the sum over the conversations that read it.
* **GRPO's micro-batches scored the same way** (:class:`SharedPromptScoring`): TRL scores a padded
  (rows, prompt + completion) block; rows of one environment share the system prompt and tools, so
  the flattened row holds that prefix once, the fused head scores it (``shift_labels``), and the
  result is scattered back into TRL's layout (a test checks log-probabilities, entropies and
  gradients against TRL's own method).

Why hand-written: flash-attention's varlen kernels need a GPU and TRL's compact fused head is
Triton-only; what is left for CPU is a loop over ``sdpa`` calls and a gather before the head. No
library trains several sequences over one copy of their common prefix (vLLM and SGLang share it in
inference only), nor samples micro-batches by a group key (transformers' ``group_by_length`` sorts
by length, which orders a run family by family). Figures: docs/performance.md.
"""

from __future__ import annotations

import contextlib
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


def attention_of(model: Any) -> str:
    """The attention implementation ``model`` runs (through PEFT and DDP-style wrappers). A shared prefix
    is only attended by :func:`sdpa_varlen_forward`: flash-attention's varlen path would take the same
    ``cu_seq_lens`` and silently let no segment see the prefix, so callers check this first."""
    core = model.get_base_model() if hasattr(model, "get_base_model") else model
    core = getattr(core, "module", core)
    return str(getattr(getattr(core, "config", None), "_attn_implementation", "") or "")


@contextlib.contextmanager
def varlen_sdpa() -> Iterator[None]:
    """Route transformers' ``sdpa`` through :func:`sdpa_varlen_forward` for the duration, for a model whose
    attention implementation stays ``sdpa`` (GRPO's policy: the generation engine overrides ``sdpa`` the
    same way, :func:`apprentice.policies.hf_cached._grouped_decode`). Unpacked inputs run plain SDPA."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_varlen_forward
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = before


def shared_prompt_row(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int,
                      min_prefix: int = MIN_SHARED_PREFIX) -> dict[str, Any] | None:
    """TRL's padded (rows, prompt + completion) block as one flattened row without padding, the rows'
    common prompt prefix kept once; None where a row's prompt or completion is not one run of tokens.

    The common prefix stops one token before the shortest prompt ends: a row's last prompt token must be
    in its own segment, where it predicts that row's first completion token. Shorter than ``min_prefix``,
    nothing is shared and every row is its own causal segment (still no padding, and a completion TRL
    masked out costs nothing). Returns the model inputs (``input_ids``, ``position_ids``,
    ``cu_seq_lens_q/k``, ``max_length_q/k``, ``shared_prefix`` where shared, ``shift_labels``: each
    position's next token where that is a completion token) and ``index``: for each (row, completion
    column) the flat position whose label is that token, -1 where the column is padding."""
    rows = input_ids.shape[0]
    width = input_ids.shape[1] - completion_len
    prompt_mask, comp_mask = attention_mask[:, :width].bool(), attention_mask[:, width:].bool()
    prompts, comps = [], []
    for i in range(rows):
        p_len, n = int(prompt_mask[i].sum()), int(comp_mask[i].sum())
        if p_len < 1 or not bool(prompt_mask[i, width - p_len:].all()) or not bool(comp_mask[i, :n].all()):
            return None  # left padding and right padding only, as TRL builds the block
        prompts.append(input_ids[i, width - p_len:width])
        comps.append(input_ids[i, width:width + n])
    shared = min(len(p) for p in prompts) - 1
    for other in prompts[1:]:
        differ = (other[:shared] != prompts[0][:shared]).nonzero()
        shared = int(differ[0]) if len(differ) else shared
    if rows < 2 or shared < min_prefix:
        shared = 0
    ids, pos, labels, seg = [], [], [], []
    if shared:
        ids, pos, labels, seg = [prompts[0][:shared]], [torch.arange(shared)], [torch.full((shared,), -100)], [shared]
    index = torch.full((rows, completion_len), -1, dtype=torch.long)
    start = shared
    for i, (p, c) in enumerate(zip(prompts, comps, strict=True)):
        own = torch.cat([p[shared:], c])
        ids.append(own)
        pos.append(torch.arange(shared, shared + len(own)))
        labels.append(torch.cat([torch.full((len(p) - shared - 1,), -100), c, torch.tensor([-100])]))
        first = start + len(p) - shared - 1  # the row's last prompt token: it predicts the first completion token
        index[i, :len(c)] = torch.arange(first, first + len(c))
        seg.append(len(own))
        start += len(own)
    cu = torch.tensor([0, *torch.tensor(seg).cumsum(0).tolist()], dtype=torch.int32)
    device = input_ids.device
    row = {"input_ids": torch.cat(ids)[None].to(device), "position_ids": torch.cat(pos)[None].to(device),
           "shift_labels": torch.cat(labels)[None].to(device), "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
           "max_length_q": max(seg), "max_length_k": max(seg), "index": index.to(device)}
    if shared:
        row[SHARED_PREFIX] = shared
    return row


class SharedPromptScoring:
    """Mixin for TRL's ``GRPOTrainer``: score a micro-batch as one flattened row without padding, over one
    copy of its rows' common prompt prefix (:func:`shared_prompt_row`); anything else (images, MoE aux
    loss) goes to TRL. Overrides the private ``_get_per_token_logps_and_entropies`` of the pinned TRL (contract
    test: tests/unit/test_library_contracts.py), keeping its signature and its returns."""

    share_prompt = True

    def _get_per_token_logps_and_entropies(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                           logits_to_keep: int, batch_size: int | None = None,
                                           compute_entropy: bool = False, compute_aux_loss: bool = False,
                                           **extra: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        parent: Any = super()
        # varlen_sdpa() routes ``sdpa`` only while this forward runs: a model on another attention, or one
        # that recomputes its forward in the backward pass (gradient checkpointing), would attend without it
        flat = (self.share_prompt and attention_of(model) == "sdpa"
                and not getattr(model, "is_activation_checkpointing", False))
        if not flat or compute_aux_loss or any(v is not None for v in extra.values()):
            return parent._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                             batch_size, compute_entropy, compute_aux_loss, **extra)
        size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), size):
            ids, mask = input_ids[start:start + size], attention_mask[start:start + size]
            row = shared_prompt_row(ids, mask, logits_to_keep)
            if row is None:
                lp, ent, _ = parent._get_per_token_logps_and_entropies(model, ids, mask, logits_to_keep,
                                                                       compute_entropy=compute_entropy)
            else:
                index = row.pop("index")
                with varlen_sdpa(), self.accelerator.autocast():  # type: ignore[attr-defined]
                    out = model(**row, fused_lm_head=True)
                where = index.clamp(min=0)
                pad = index < 0
                lp = out.log_probs[0][where].masked_fill(pad, 0.0)
                ent = None if out.entropy is None else out.entropy[0][where].masked_fill(pad, 0.0)
            logps.append(lp)
            if compute_entropy:
                entropies.append(ent)
        return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None
