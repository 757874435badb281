"""The generation engine of every local model: batched decoding with KV-cache reuse across turns.

Why reuse: a multi-turn episode re-sends its whole conversation every turn and ``model.generate``
re-encodes it from scratch; on a CPU that prefill costs as much as the decoding itself (batching does
not help: prefill is compute-bound at batch size 1). This engine keeps, per conversation, the
keys/values of everything it has encoded and runs only the *new* tokens (the tool observation, then
the reply); episodes of one environment also share one encoding of their common prefix (system
prompt + tool schemas). transformers' continuous batching (``generate_batch``) keeps no cache
between requests. vLLM's CPU build does (``--enable-prefix-caching`` serves a conversation's next turn
from the blocks of its last one), but as a server in an environment of its own (it pins an older
transformers than this project), compiling the model at every start, and without replacing a running
model's weights on CPU, so it cannot sample from a model that changes every optimizer step (GRPO,
on-policy distillation). ``bench/engine_peak.py`` measures both against the machine's peak and
``--vllm-url`` adds a running vLLM server to its table; a local teacher or evaluation can be pointed at
such a server through the OpenAI-compatible policy.

In bf16 the forward passes run on bf16 copies of the weights with fused projections
(:mod:`apprentice.lm.fused`, Llama-architecture models), re-made when the weights change
(:meth:`CachedHFPolicy.sync_weights`); in fp32, and for other architectures, on the transformers model.

Where it departs from ``generate``: a hand-written decode loop over one preallocated ``StaticCache``
whose buffers are reused from call to call (:class:`_EngineLayer`), from which finished rows leave
(compaction) instead of decoding pads; prefill in chunks run by the rows that have tokens there
(:func:`prefill_plan`) with grouped-query SDPA (:func:`_gqa_sdpa`); decode steps that read only each
group of rows' own columns (:func:`_grouped_sdpa`). The loop earns its place only while it beats
``generate`` fed the same cache, which ``bench/generation_engines.py`` compares.

Layout of one call: row ``i`` is ``[pad | reused prefix, right-aligned at C | pad | new tokens,
right-aligned at C+S]``, with explicit positions, so every token sits at its true position.
Correctness: the key/value of position ``p`` depends only on tokens ``<= p``, so reusing it for an
identical prefix of *token ids* is exact up to floating-point summation order (a test checks greedy
episodes against one-at-a-time ``generate`` in fp32 and bf16); a re-rendered turn that tokenizes
differently from what was generated simply reuses less.

Drafts (:meth:`CachedHFPolicy.add_drafts`, greedy only) are speculative decoding ("Fast Inference
from Transformers via Speculative Decoding", arXiv:2211.17192) with a parent model's transcript as
the draft model. Departures from the paper: no sampling rule; a token is accepted only when it leads
the runner-up by ``DRAFT_MARGINS`` (not on argmax equality alone), so a near-tie that a prefill and a
decode step could round apart is left to decoding; a row whose draft goes wrong keeps the tokens
before the first rejected one and decodes on from there. Memory is bounded in bytes (``kv_gb``, see
:class:`CachedHFPolicy`); the engine's figures are in docs/performance.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import StaticLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from apprentice.lm import fused as fused_lm
from apprentice.lm import modeling
from apprentice.policies.base import Message, Turn
from apprentice.policies.hf import HFPolicy
from apprentice.policies.toolcalls import parse_assistant

MIN_SHARED_PREFIX = 16  # tokens; shorter common prefixes are not worth a separate forward pass


@dataclass(eq=False)  # identity: the store removes entries by identity, never by comparing their arrays
class _Entry:
    ids: np.ndarray  # token ids whose keys/values are stored
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (kv_heads, len, head_dim)
    used: float = 0.0
    shared: bool = False  # a common prefix of several conversations: never "superseded"


def _conversation_key(conversation: list[Message], tools: list[dict[str, Any]] | None) -> str:
    return json.dumps([conversation, tools or []], sort_keys=True, default=str)


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.nonzero(a[:n] != b[:n])[0]
    return int(diff[0]) if diff.size else n


PREFILL_CALL_COST = 48  # token-rows: a forward's fixed cost (weights read once) at prefill speed
PREFILL_SWAP_COST = 4  # token-rows per row copied into and out of a sub-batch's cache


def prefill_plan(new: list[int], width: int) -> list[tuple[int, int, list[int] | None]]:
    """Chunks ``(first column, end column, rows or None for all)`` covering ``width`` prefill
    columns whose row ``i`` holds its ``new[i]`` tokens right-aligned. Chosen by dynamic programming
    over the distinct lengths to minimise padded token-rows plus each chunk's fixed cost (the two
    constants above: orders of magnitude, not tuned). The last chunk is always every row: every row
    has at least its last token there."""
    cuts = sorted({n for n in new if 0 < n < width}, reverse=True) + [0]
    points = [width, *cuts]  # distance from the right edge, decreasing; the chunks run left to right

    def cost(i: int, j: int) -> float:  # columns at distance (points[j], points[i]] by rows longer than points[j]
        rows = sum(n > points[j] for n in new)
        swap = 0 if rows == len(new) else PREFILL_SWAP_COST * rows
        return rows * (points[i] - points[j]) + PREFILL_CALL_COST + swap

    best = [0.0] + [float("inf")] * (len(points) - 1)
    back = [0] * len(points)
    for j in range(1, len(points)):
        for i in range(j):
            c = best[i] + cost(i, j)
            if c < best[j]:
                best[j], back[j] = c, i
    chain, j = [], len(points) - 1
    while j:
        chain.append((back[j], j))
        j = back[j]
    plan = []
    for i, j in reversed(chain):
        rows = [r for r, n in enumerate(new) if n > points[j]]
        plan.append((width - points[i], width - points[j], None if len(rows) == len(new) else rows))
    return plan


class _EngineLayer(StaticLayer):
    """transformers' ``StaticLayer`` (pinned ==5.24.0; contract: ``tests/unit/test_library_contracts.py``)
    with two changes for the engine:

    * ``update`` casts the new keys/values to the cache's dtype instead of failing on a mismatch
      (see :meth:`CachedHFPolicy._kv_dtype_of`);
    * ``lazy_initialization`` carves its keys/values out of the engine's reusable flat buffers
      (``buffers``) instead of allocating and zero-filling a fresh ``[batch, heads, length, dim]``
      pair per layer on every call (a zero-fill that shows up in a rollout's profile).
      Masked positions only need *finite* values (a masked score is -inf or the dtype's minimum, so
      its softmax weight is exactly 0 and ``0 * v`` is exactly 0), and the buffers only ever hold
      zeros or keys/values the model wrote, so attention is bit-identical to a zeroed cache.
    """

    buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if self.buffers is None:
            return super().lazy_initialization(key_states, value_states)
        self.device = key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        kshape = (self.batch_size, self.num_heads, self.max_cache_len, self.k_head_dim)
        vshape = (self.batch_size, self.num_heads, self.max_cache_len, self.v_head_dim)
        kbuf, vbuf = self.buffers
        self.keys = kbuf[: math.prod(kshape)].view(kshape)
        self.values = vbuf[: math.prod(vshape)].view(vshape)
        self.cumulative_length = self.cumulative_length.to(self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.is_initialized and self.keys is not None and self.values is not None:
            key_states, value_states = key_states.to(self.keys.dtype), value_states.to(self.values.dtype)
        return super().update(key_states, value_states, *args, **kwargs)


def _compacted(t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Rows ``keep`` (ascending) of ``t`` moved to its first rows, in place; their view. In place
    because ``t`` is a view of the engine's buffers, which outlive the call: a gathered copy per
    layer (``t[keep]``) would hold a second whole cache beside them."""
    n = keep.numel()
    t[:n] = t.index_select(0, keep)  # one layer's rows at a time: the transient copy is 1/layers of the cache
    return t[:n]


_FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"


@contextlib.contextmanager
def _gqa_sdpa() -> Iterator[None]:
    """Let transformers' SDPA attention read the grouped keys/values directly (``enable_gqa``) even
    with a mask, instead of ``repeat_kv``-copying them to every query head first. transformers only
    does so unmasked (a CUDA kernel restriction); on CPU, torch's kernel takes the mask, the result is
    bit-identical, and a prefill chunk's attention skips the copy (``TRANSFORMERS_SDPA_FORCE_GQA`` is
    read per call: contract test in ``tests/unit/test_library_contracts.py``). Only around prefill:
    one-token decode steps already fold the query heads onto the key/value heads (``pack_gqa``),
    slightly faster still in fp32."""
    old = os.environ.get(_FORCE_GQA)
    os.environ[_FORCE_GQA] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(_FORCE_GQA, None)
        else:
            os.environ[_FORCE_GQA] = old


GROUP_COST = 2048  # row-columns: the fixed cost of one more group's attention calls in a step, in units of
#                    one row-column read (an order of magnitude, not tuned)


def decode_groups(starts: list[int], end: int) -> list[tuple[int, int, int]]:
    """Consecutive row ranges ``(first row, end row, first column)`` for one decode step over columns
    ``[first column, end)``: ``starts`` (ascending) is each row's first used column. Chosen by dynamic
    programming to minimise the key/value columns read, ``rows x (end - first column)`` per group,
    plus ``GROUP_COST`` per group."""
    n = len(starts)
    best = [0.0] + [math.inf] * n
    back = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            c = best[i] + (j - i) * (end - starts[i]) + GROUP_COST
            if c < best[j]:
                best[j], back[j] = c, i
    out, j = [], n
    while j:
        out.append((back[j], j, starts[back[j]]))
        j = back[j]
    return out[::-1]


def worth_reordering(saved: float, steps: int, cache: int) -> bool:
    """Whether sorting a call's rows for :func:`decode_groups` pays: it moves the whole cache once
    (read + write, ``2 x cache`` row-columns) to save ``saved`` row-columns on each of ``steps``."""
    return saved * steps > 2 * cache


_DECODE_SPAN: contextvars.ContextVar[tuple[list[tuple[int, int, int]], int] | None] = \
    contextvars.ContextVar("apprentice_decode_span", default=None)


def _grouped_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, restricted in a decode step to the columns each group of rows
    uses (:data:`_DECODE_SPAN`: groups and the end column); anywhere else, SDPA unchanged.

    Why: a call's cache is as wide as its longest conversation, and SDPA reads every column, masked
    or not. With many rows a decode step is bound by reading keys/values, and in evaluation much of
    what it reads is padding: episodes admitted late (short) decode beside ones several times
    longer. Rows sorted by first used column and cut into groups read only their own span, and no
    group reads the columns not generated yet.
    The masked columns left out had softmax weight exactly 0, so only the summation order changes."""
    span = _DECODE_SPAN.get()
    if span is None or query.shape[2] != 1 or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    groups, end = span

    def rows(m: torch.Tensor, a: int, b: int, s: int) -> torch.Tensor:  # a mask may broadcast its batch
        return (m[a:b] if m.shape[0] > 1 else m)[..., s:end]

    outs = [sdpa_attention_forward(module, query[a:b], key[a:b, :, s:end], value[a:b, :, s:end],
                                   None if attention_mask is None else rows(attention_mask, a, b, s), **kwargs)[0]
            for a, b, s in groups]
    return torch.cat(outs), None


@contextlib.contextmanager
def _grouped_decode() -> Iterator[None]:
    """Route transformers' ``sdpa`` attention through :func:`_grouped_sdpa` for the duration: the
    override goes into the global interface's *local* mapping, the mechanism transformers provides
    for overriding an attention function (pinned ==5.24.0; contract test in
    ``tests/unit/test_library_contracts.py``). Outside a decode step (:data:`_DECODE_SPAN` unset)
    the override calls SDPA unchanged, so another thread's forward passes are unaffected."""
    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = _grouped_sdpa
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = before


KV_GB = 3.2  # keys/values the engine may hold: the prefix store plus one call's decode buffers
STORE_SHARE = 0.45  # of KV_GB for the store; the rest bounds a call's buffers (larger calls are split)
# logits a draft token must lead the runner-up by (_verify), per compute dtype, set from the gap between a decode
# step's logits and a prefill's over the same tokens (experiments/draft_margin.py). fp32: orders of magnitude above that
# gap, so a draft decides exactly what decoding would. bf16 autocast: the gap can reach most of a logit and flip an
# argmax; 0.5 rather than a margin above the largest gap, because bf16 transcripts already move with batch
# composition and thread count, and a wider margin rejects far more drafts for few more identical transcripts.
DRAFT_MARGINS = {torch.float32: 0.05, torch.float64: 0.05}
DRAFT_MARGIN_LOW_PRECISION = 0.5  # bf16 / fp16 (fused copies or autocast)
VERIFY_LOGIT_BYTES = 64e6  # the logits of one slice of rows in _verify (vocabulary x positions, fp32)
TRIM_BYTES = 64e6  # freed keys/values above which a call hands the heap's free pages back (trim_heap)


class CachedHFPolicy(HFPolicy):
    """Same constructor and outputs as :class:`HFPolicy`.

    Memory: ``kv_gb`` bounds the keys/values held at once, in bytes, so the bound is the same in
    fp32 and bf16 (a token's keys/values take twice the bytes in fp32). ``STORE_SHARE`` of it caps
    the prefix store (``cache_tokens``, derived unless given); the rest caps one call's decode
    buffers: a call whose rows x cache width would pass it runs as several smaller calls
    (:meth:`_split`). Why bytes: resident memory is what runs out, and a budget in tokens sized
    for bf16 would hold twice the bytes in fp32.
    """

    def __init__(self, *args: Any, cache_tokens: int | None = None, kv_gb: float = KV_GB, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._store: list[_Entry] = []
        cfg = self.model.config
        self._kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self._head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        layers = len(self.model.model.layers) if hasattr(self.model, "model") else cfg.num_hidden_layers
        itemsize = torch.finfo(self.dtype).bits // 8  # the cache's dtype is the compute dtype's (_kv_dtype_of)
        self.token_bytes = 2 * layers * self._kv_heads * self._head_dim * itemsize  # keys + values, all layers
        self.cache_tokens = cache_tokens if cache_tokens is not None else int(kv_gb * 1e9 * STORE_SHARE) // self.token_bytes
        self.buffer_tokens = int(kv_gb * 1e9 * (1 - STORE_SHARE)) // self.token_bytes  # rows x width of one call
        # counters for a caller to read or print (stats_line): what the calls cost and what they saved
        self.stats: dict[str, float] = {"prompt_tokens": 0, "reused_tokens": 0, "drafted_rows": 0, "accepted_rows": 0,
                                        "draft_tokens_kept": 0, "prefill_tokens": 0, "prefill_slots": 0,
                                        "calls": 0, "parts": 0, "decode_steps": 0, "row_steps": 0,
                                        "prefill_s": 0.0, "decode_s": 0.0}
        self._drafts: dict[str, Message] = {}  # conversation (canonical JSON) -> its likely next turn (add_drafts)
        self._row_tokens = 0.0  # mean tokens a row of the last call stores (live_rows)
        self._pinned: dict[int, _Entry] = {}  # entries a running call's later parts reuse, by id (held: ids stay unique)
        self._kv_dtype: torch.dtype | None = None
        # low-precision generation runs on bf16 copies of the weights (apprentice.lm.fused) where the
        # architecture allows; fp32 runs the transformers model itself
        self._fused: fused_lm.FusedLlama | None = None
        self.fused = self.dtype in (torch.bfloat16, torch.float16) and fused_lm.supports(self.model)
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer, flat; grown, never shrunk

    def stats_line(self) -> str:
        """One line on where this engine's time went: the place to look first when generation is slow
        (a call split into many parts, most prompt tokens re-encoded, decode steps with few rows)."""
        s = self.stats
        line = (f"{s['calls']:.0f} calls in {s['parts']:.0f} parts, prefill {s['prefill_s']:.1f} s "
                f"({s['prefill_tokens']:.0f} tokens in {s['prefill_slots']:.0f} slots), "
                f"{s['decode_steps']:.0f} decode steps ({s['row_steps'] / max(s['decode_steps'], 1):.1f} rows each) "
                f"{s['decode_s']:.1f} s, prompt tokens reused {s['reused_tokens'] / max(s['prompt_tokens'], 1):.0%}")
        if s["drafted_rows"]:
            line += (f", drafts accepted {s['accepted_rows']:.0f} / {s['drafted_rows']:.0f} "
                     f"({s['draft_tokens_kept']:.0f} draft tokens kept)")
        return line

    def live_rows(self, batch_size: int) -> int:
        """How many conversations the rollout loop should play at once when asked for ``batch_size``
        (:func:`apprentice.rollout.episodes.run_episodes` asks every round): as many as the prefix store holds
        at the size this engine's last call's rows will have after the next call (prompt +
        ``max_new_tokens`` + the new tokens a row brought to the last call, which the next brings
        again: an observation and a turn's template tokens), at most ``batch_size``.

        Why: the rounds are lock-step, so when the live conversations pass the store's ``cache_tokens``
        the least recently used entry dropped is always one the next round needs, and every turn
        re-encodes its whole conversation. ``kv_gb`` is a byte budget, so fp32 meets that first (in
        bf16 the store holds twice the tokens and the rule rarely binds). Why the growth term: sized
        at the last call alone, the live rows passed the store at the next, whose last entries to
        finish (its first parts, when it split) were then dropped and re-encoded."""
        if not self._row_tokens:
            return batch_size
        return max(1, min(batch_size, int(self.cache_tokens // self._row_tokens)))

    def add_drafts(self, episodes: Iterable[tuple[list[Message], list[dict[str, Any]]]]) -> int:
        """Remember each assistant turn of finished ``episodes`` (messages, tools) as a draft: when a
        greedy call meets the same prompt, the turn's tokens run in one prefill and are the completion
        if the model would have produced them itself (:meth:`_verify`). Returns the drafts added.

        Why: evaluation scores a model trained a few steps from one already scored on the same
        problems (RL from SFT, the student from the RL teacher), and most of its greedy turns are the
        ones its parent played. Checking a turn's tokens costs one prefill over them, several times
        cheaper per token than decoding them one step at a time; a turn that differs costs that
        prefill in vain and decodes as before. This is speculative decoding ("Fast Inference from
        Transformers via Speculative Decoding", arXiv:2211.17192) with the parent's transcript as the
        draft model. A draft that goes wrong still gives its
        tokens before the first wrong one: the row decodes on from there.

        Conversations are matched by content (JSON with sorted keys: stored episodes come back from
        Parquet with their keys sorted, and a template renders tool schemas in key order). A draft is
        the chat template's rendering of the stored assistant message (:meth:`_draft_ids`), so a
        model that wrote a turn in another form than the template's simply does not match."""
        added = 0
        for messages, tools in episodes:
            for t, m in enumerate(messages):
                if t and m.get("role") == "assistant":
                    self._drafts[_conversation_key(messages[:t], tools)] = m
                    added += 1
        return added

    @property
    def drafts_exact(self) -> bool:
        """Whether an accepted draft is exactly what decoding would give: in fp32, where a prefill's logits
        and a decode step's differ by far less than ``DRAFT_MARGINS``; in bf16 the two round differently and
        the calls that verify drafts group rows differently, so a few episodes may come out otherwise."""
        return self.dtype in DRAFT_MARGINS

    def _draft_ids(self, conversation: list[Message], tools: list[dict[str, Any]], prompt: str,
                   max_new_tokens: int) -> np.ndarray | None:
        """The draft for ``conversation``'s next turn as token ids (up to and including the end-of-turn
        token, at most ``max_new_tokens``), or None: the stored turn rendered after ``prompt``."""
        msg = self._drafts.get(_conversation_key(conversation, tools))
        if msg is None:
            return None
        full = self.tokenizer.apply_chat_template([*conversation, msg], tools=tools or None, tokenize=False)
        if not full.startswith(prompt):
            return None
        reply = self.tokenizer(full[len(prompt):], add_special_tokens=False)["input_ids"]
        stop = next((k for k, x in enumerate(reply) if x in self.stop_ids), None)
        return None if stop is None else np.asarray(reply[:stop + 1][:max_new_tokens], dtype=np.int64)

    @classmethod
    def from_policy(cls, policy: HFPolicy, **kwargs: Any) -> CachedHFPolicy:
        """The same model, tokenizer and sampling settings as an existing ``HFPolicy`` (``kwargs``
        override any of them, e.g. ``dtype``)."""
        kw: dict[str, Any] = dict(temperature=policy.temperature, top_p=policy.top_p,
                                  max_new_tokens=policy.max_new_tokens, batch_size=policy.batch_size,
                                  dtype=policy.dtype, seed=policy.seed, policy_id=policy.policy_id)
        return cls(policy.model, policy.tokenizer, **{**kw, **kwargs})

    def reset_cache(self) -> None:
        """Forget every stored conversation and free the decode buffers (the weight copies stay: they
        are refreshed when the weights change, see :meth:`sync_weights`)."""
        self._store.clear()
        self._buffers = []

    def sync_weights(self) -> bool:
        """Make the bf16 weight copies (:mod:`apprentice.lm.fused`) match the model's current weights;
        True when they were (re)made. Every call does this first, so a model trained between calls
        (GRPO, on-policy distillation) generates with its new weights; the stored keys/values of the
        old weights are dropped with them. A no-op for fp32 and for architectures the copies do not cover."""
        if not self.fused:
            return False
        if self._fused is None:
            self._fused = fused_lm.FusedLlama(self.model, self.dtype)
            return True
        if self._fused.sync():
            self._store.clear()
            return True
        return False

    def _generation_context(self) -> contextlib.AbstractContextManager[Any]:
        """What a call's forward passes run under: no autograd, and for the transformers model bf16
        autocast (in low precision) and the grouped decode attention; the fused path needs neither."""
        if self._fused is not None:
            return torch.no_grad()
        stack = contextlib.ExitStack()
        stack.enter_context(modeling.generation(self.dtype, self.device))
        stack.enter_context(_grouped_decode())
        return stack

    def _model_forward(self, cache: Any, logits_to_keep: int | None = 1, spans: list[tuple[int, int, int]] | None = None,
                       **inputs: Any) -> torch.Tensor:
        """One forward pass over the engine's cache: logits of the last ``logits_to_keep`` positions
        (fp32 under the fused path, the model's dtype otherwise), or the final hidden states when
        ``logits_to_keep`` is None. ``spans``: :func:`_grouped_sdpa`'s decode groups."""
        if self._fused is None:
            if logits_to_keep is None:
                return self.model.get_decoder()(cache=cache, use_cache=True, **inputs).last_hidden_state
            return self.model(cache=cache, use_cache=True, logits_to_keep=logits_to_keep, **inputs).logits
        ids = inputs["input_ids"]
        start = int(cache.layers[0].cumulative_length)
        hidden = self._fused.decoder(ids, inputs["position_ids"], inputs["attention_mask"],
                                     [(layer.keys, layer.values) for layer in cache.layers], start, spans)
        for layer in cache.layers:
            layer.cumulative_length.fill_(start + ids.shape[1])
        return hidden if logits_to_keep is None else self._fused.logits(hidden[:, -logits_to_keep:])

    def _layer_buffers(self, layers: int, numel: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Flat key/value buffers of at least ``numel`` elements per layer (see :class:`_EngineLayer`),
        grown by 25 % over the need so that slowly growing conversations do not reallocate every turn."""
        if not self._buffers or self._buffers[0][0].numel() < numel or self._buffers[0][0].dtype != dtype:
            cap = self.buffer_tokens * self._kv_heads * self._head_dim  # per layer, keys (values alike)
            n = max(numel, min(int(numel * 1.25), cap))
            self._buffers = []  # free the old ones before allocating
            self._buffers = [(torch.zeros(n, dtype=dtype, device=self.device), torch.zeros(n, dtype=dtype, device=self.device))
                             for _ in range(layers)]
        return self._buffers

    # -- prefix store --------------------------------------------------------------------------
    def _best(self, ids: np.ndarray) -> tuple[_Entry | None, int]:
        best, n = None, 0
        for e in self._store:
            k = _lcp(e.ids, ids)
            if k > n:
                best, n = e, k
        return best, n

    def _evict(self, reserve: int = 0) -> int:
        """Drop least recently used entries until the store plus ``reserve`` tokens fit ``cache_tokens``;
        return the tokens dropped. Entries the running call's later parts reuse (``_pinned``, see
        :meth:`_run`) stay, even if the store passes its cap until that call ends."""
        total = sum(len(e.ids) for e in self._store) + reserve
        dropped = 0
        for e in sorted(self._store, key=lambda e: e.used):
            if total <= self.cache_tokens:
                break
            if id(e) in self._pinned:
                continue
            self._store.remove(e)
            total -= len(e.ids)
            dropped += len(e.ids)
        return dropped

    def _add_shared_prefixes(self, rows: list[np.ndarray], hits: list[int]) -> None:
        """Encode once the common prefix of conversations that have nothing cached yet."""
        fresh = sorted((i for i, h in enumerate(hits) if h < MIN_SHARED_PREFIX), key=lambda i: rows[i].tolist())
        groups: list[tuple[list[int], int]] = []
        for i in fresh:
            if groups:
                members, n = groups[-1]
                k = min(n, _lcp(rows[members[-1]], rows[i]))
                if k >= MIN_SHARED_PREFIX:
                    groups[-1] = ([*members, i], k)
                    continue
            groups.append(([i], len(rows[i])))
        for members, n in groups:
            if len(members) < 2:
                continue
            n = min(n, min(len(rows[i]) for i in members) - 1)  # leave every row >= 1 token to run
            if n < MIN_SHARED_PREFIX:
                continue
            ids = rows[members[0]][:n]
            kv = self._encode_alone(ids)
            self._store.append(_Entry(ids=ids, kv=kv, used=time.monotonic(), shared=True))

    def _kv_dtype_of(self) -> torch.dtype:
        """The one dtype keys and values are cached in: the dtype attention reads them in, found once
        by encoding one token. Under bf16 autocast with fp32 weights the model *writes* them in two
        dtypes (values come out of a bf16 matmul, keys out of RoPE, which multiplies by fp32 cos/sin;
        a cache of one dtype fails on the other: ``index_copy_(): self and source expected to have
        the same dtype``), but autocast casts SDPA's query, keys and values to bf16
        before it reads them, so fp32 keys only double the memory traffic of every decode step's
        attention. :class:`_EngineLayer` stores them in the values' dtype: bit-identical
        attention, half the bytes."""
        if self._kv_dtype is None and self._fused is not None:
            self._kv_dtype = self._fused.dtype
        if self._kv_dtype is None:
            kv = self._encode_alone(np.asarray([self.tokenizer.pad_token_id or 0], dtype=np.int64))
            self._kv_dtype = kv[0][1].dtype
        return self._kv_dtype

    def _encode_alone(self, ids: np.ndarray) -> list[tuple[torch.Tensor, torch.Tensor]]:
        from transformers import DynamicCache

        cache: Any = DynamicCache(config=self.model.config)  # Any: its layers' union type lacks .keys
        x = torch.tensor(ids[None, :], device=self.device)
        if self._fused is not None:
            n, f = len(ids), self._fused
            kv = [(torch.empty(1, f.kv_heads, n, f.head_dim, dtype=f.dtype, device=self.device),
                   torch.empty(1, f.kv_heads, n, f.head_dim, dtype=f.dtype, device=self.device)) for _ in f.layers]
            with torch.no_grad():
                f.decoder(x, torch.arange(n, device=self.device)[None], torch.ones_like(x), kv, 0)
            return [(k[0], v[0]) for k, v in kv]
        with modeling.generation(self.dtype, self.device):
            self.model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1)
        dtype = self._kv_dtype or cache.layers[0].values.dtype
        return [(layer.keys[0].to(dtype), layer.values[0].to(dtype)) for layer in cache.layers]

    # -- generation ----------------------------------------------------------------------------
    def _split(self, reuse: list[int], new: list[int], max_new_tokens: int) -> list[tuple[int, int]]:
        """Consecutive ``(start, end)`` ranges of rows whose decode buffers fit ``buffer_tokens``: rows
        x (longest reused prefix + most new tokens + ``max_new_tokens``), the cache layout of
        :meth:`_decode`, with the reuse found in the store now. One range when the whole call fits; a
        row too long for the budget alone still runs (alone). The rollout loop sends the longest rows
        first, so a split leaves the short ones together."""
        out, start, c, n = [], 0, 0, 0
        for i, (r, k) in enumerate(zip(reuse, new, strict=True)):
            c2, n2 = max(c, r), max(n, k)
            if i > start and (i - start + 1) * (c2 + n2 + max_new_tokens) > self.buffer_tokens:
                out.append((start, i))
                start, c2, n2 = i, r, k
            c, n = c2, n2
        return [*out, (start, len(reuse))]

    def _generate(self, convs: list[list[Message]], tools: list[list[dict[str, Any]]],
                  temperature: float, top_p: float, max_new_tokens: int) -> list[Turn]:
        tok = self.tokenizer
        prompts = [self.render(c, t) for c, t in zip(convs, tools, strict=True)]
        rows = [np.asarray(tok(p, add_special_tokens=False)["input_ids"], dtype=np.int64) for p in prompts]
        drafts = None
        if temperature == 0 and self._drafts:
            drafts = [self._draft_ids(c, t, p, max_new_tokens) for c, t, p in zip(convs, tools, prompts, strict=True)]
        return [self._turn(r, ids, reused) for r, (ids, reused)
                in zip(rows, self._run(rows, temperature, top_p, max_new_tokens, drafts), strict=True)]

    def complete_ids(self, prompts: list[list[int]], *, temperature: float | None = None, top_p: float | None = None,
                     max_new_tokens: int | None = None) -> list[list[int]]:
        """Completions of prompts given as token ids: each one's ids up to and including its first stop
        id (``stop_ids``), or ``max_new_tokens`` of them. The same engine, store and memory budget as
        conversations; what GRPO samples with (:mod:`apprentice.training.rl`), where TRL hands over
        token ids, not messages."""
        temperature = self.temperature if temperature is None else temperature
        top_p = self.top_p if top_p is None else top_p
        max_new_tokens = max_new_tokens or self.max_new_tokens
        rows = [np.asarray(p, dtype=np.int64) for p in prompts]
        out: list[list[int]] = []
        for s in range(0, len(rows), self.batch_size):
            out += [ids for ids, _ in self._run(rows[s:s + self.batch_size], temperature, top_p, max_new_tokens)]
        return out

    def _run(self, rows: list[np.ndarray], temperature: float, top_p: float, max_new_tokens: int,
             drafts: list[np.ndarray | None] | None = None) -> list[tuple[list[int], int]]:
        """(completion ids, reused prompt tokens) per row: :meth:`_decode` over the parts :meth:`_split` makes.

        While a part runs, the entries the parts after it will reuse are pinned: each part makes room
        for what it stores (:meth:`_evict`) and drops the entries its rows extend, and least recently
        used were exactly the entries of the parts after it, which then re-encoded whole conversations."""
        self.sync_weights()  # before matching: new weights drop the store
        matches = [self._best(r) for r in rows]
        reuse = [min(n, len(r) - 1) for r, (_, n) in zip(rows, matches, strict=True)]
        if rows:  # what a row of this workload takes in the store (live_rows)
            # what a row stores after this call (prompt + reply), and after the next one: it grows again by
            # about as many new tokens as it brought to this one (an observation, a reply's template tokens)
            grown = sum(len(r) - k for r, k in zip(rows, reuse, strict=True)) / len(rows)
            self._row_tokens = sum(len(r) for r in rows) / len(rows) + max_new_tokens + grown
        drafts = drafts if drafts is not None and temperature == 0 else [None] * len(rows)
        new = [len(r) - k + (len(d) - 1 if d is not None else 0) for r, k, d in zip(rows, reuse, drafts, strict=True)]
        out: list[tuple[list[int], int]] = []
        parts = self._split(reuse, new, max_new_tokens)
        self.stats["calls"] += 1
        self.stats["parts"] += len(parts)
        try:
            for a, b in parts:
                self._pinned = {id(e): e for e, _ in matches[b:] if e is not None}  # what the parts after this reuse
                # matches again: an earlier part may have freed entries
                out += self._decode(rows[a:b], temperature, top_p, max_new_tokens, drafts[a:b])
        finally:
            self._pinned = {}
        self._evict()
        return out

    def _turn(self, row: np.ndarray, gen_ids: list[int], reused: int) -> Turn:
        stop_at = next((k for k, t in enumerate(gen_ids) if t in self.stop_ids), None)
        text = self.tokenizer.decode(gen_ids if stop_at is None else gen_ids[:stop_at], skip_special_tokens=True)
        msg, err = parse_assistant(text)
        return Turn(message=msg, prompt_tokens=len(row), completion_tokens=len(gen_ids), parse_error=err, raw=text,
                    extra={"finish_reason": "length" if stop_at is None else "stop", "cached_tokens": reused})

    def _decode(self, rows: list[np.ndarray], temperature: float, top_p: float, max_new_tokens: int,
                drafts: list[np.ndarray | None] | None = None) -> list[tuple[list[int], int]]:
        """One batched call: (completion ids, reused prompt tokens) per row, in the caller's order; every
        row's keys/values (prompt + completion) go into the store. A row with a draft (greedy only, see
        :meth:`add_drafts`) runs it in the prefill after its prompt; the draft is its completion when
        every draft token is the model's own confident argmax (:meth:`_verify`), else the row keeps the
        draft's tokens before the first that is not and decodes on from there, the rest of the draft's
        columns masked out."""
        from transformers import StaticCache

        tok = self.tokenizer
        hits = [self._best(r)[1] for r in rows]
        self._add_shared_prefixes(rows, hits)
        matches = [self._best(r) for r in rows]
        # reuse at most len-1 tokens: the last prompt token must run to give the next-token logits
        reuse = [min(n, len(r) - 1) if e is not None else 0 for r, (e, n) in zip(rows, matches, strict=True)]
        drafts = drafts or [None] * len(rows)
        extra = [0 if d is None else len(d) - 1 for d in drafts]  # draft tokens run in the prefill
        # rows with the most new tokens first: every prefill sub-batch is then a prefix of the rows, a
        # view of the cache, not a gathered copy of a sub-batch's keys/values
        order = sorted(range(len(rows)), key=lambda i: reuse[i] - len(rows[i]) - extra[i])
        rows, matches, reuse = [rows[i] for i in order], [matches[i] for i in order], [reuse[i] for i in order]
        drafts, extra = [drafts[i] for i in order], [extra[i] for i in order]
        B = len(rows)
        C = max(reuse)
        S = max(len(r) - c + x for r, c, x in zip(rows, reuse, extra, strict=True))
        total = C + S + max_new_tokens
        layers = len(self.model.model.layers) if hasattr(self.model, "model") else self.model.config.num_hidden_layers

        kv_dtype = self._kv_dtype_of()
        cache: Any = StaticCache(config=self.model.config, max_cache_len=total)
        buffers = self._layer_buffers(layers, B * self._kv_heads * total * self._head_dim, kv_dtype)
        for layer, buf in zip(cache.layers, buffers, strict=True):
            layer.__class__ = _EngineLayer
            layer.buffers = buf
        cache.early_initialization(B, self._kv_heads, self._head_dim, kv_dtype, self.device)
        # layout per row: [pad | reused prefix (right-aligned to C) | pad | new tokens (right-aligned to C+S)]
        mask = torch.zeros(B, total, dtype=torch.long, device=self.device)
        ids = torch.full((B, S), tok.pad_token_id, dtype=torch.long, device=self.device)
        pos = torch.zeros(B, S, dtype=torch.long, device=self.device)
        for i, (r, c, (e, _), d) in enumerate(zip(rows, reuse, matches, drafts, strict=True)):
            if c:
                for li in range(layers):
                    k, v = e.kv[li]  # type: ignore[union-attr]
                    cache.layers[li].keys[i, :, C - c:C] = k[:, :c]
                    cache.layers[li].values[i, :, C - c:C] = v[:, :c]
                mask[i, C - c:C] = 1
                e.used = time.monotonic()  # type: ignore[union-attr]
            new = r[c:] if d is None else np.concatenate([r[c:], d[:-1]])
            ids[i, S - len(new):] = torch.from_numpy(new)
            pos[i, S - len(new):] = torch.arange(c, c + len(new))
            mask[i, C + S - len(new):C + S] = 1
        # the rows' new encodings (harvested below) supersede the entries they extend (shared prefixes
        # stay for other episodes): free those now, not after decoding, so that the old and the new
        # copy of every conversation's keys/values never coexist
        superseded = {id(e): e for e, _ in matches if e is not None and not e.shared and id(e) not in self._pinned}
        freed = sum(len(e.ids) for e in superseded.values())
        for e in superseded.values():
            e.kv = []
        self._store = [e for e in self._store if id(e) not in superseded]
        # and make room for what this call will store (every row's prompt + reply) *before* decoding:
        # evicting only afterwards let the store hold the cap's worth of finished episodes plus every
        # live row's new copy at once
        freed += self._evict(reserve=sum(len(r) for r in rows) + B * max_new_tokens)
        if freed * self.token_bytes > TRIM_BYTES:  # a trim walks the heap: not for a few small entries
            modeling.trim_heap()
        self.stats["prompt_tokens"] += sum(len(r) for r in rows)
        self.stats["reused_tokens"] += sum(reuse)
        K = max(extra) + 1 if any(d is not None for d in drafts) else 0  # prefill columns whose logits are checked

        sample = temperature > 0
        gen = torch.Generator(device=self.device)
        self._calls += 1
        gen.manual_seed(self.seed + self._calls)
        stop = torch.tensor(self.stop_ids, device=self.device)
        out = torch.full((B, max_new_tokens), tok.pad_token_id, dtype=torch.long, device=self.device)
        n_gen = [max_new_tokens] * B
        act = torch.arange(B, device=self.device)  # batch position -> row; finished rows leave the batch
        done = torch.zeros(B, dtype=torch.bool, device=self.device)
        next_pos = torch.tensor([len(r) for r in rows], device=self.device)
        off = torch.zeros(B, dtype=torch.long, device=self.device)  # per row: completion tokens a draft gave
        kv_rows: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        cur = C
        # each row's first used column: decode steps read only from there (_grouped_sdpa)
        first = torch.tensor([C - c if c else C + S - (len(r) - c + x) for r, c, x in zip(rows, reuse, extra, strict=True)],
                             device=self.device)

        def harvest(positions: list[int]) -> None:
            """Copy out each row's encoded keys/values: prompt + reply without its last token."""
            for b in positions:
                i = int(act[b])
                keep = mask[b, :cur].nonzero().squeeze(-1)[: len(rows[i]) + n_gen[i] - 1]
                # index_select, not ``[:, keep]``: advanced indexing runs a general gather kernel over
                # the strided view, far slower per element than index_select's copy of whole rows
                kv_rows[i] = [(layer.keys[b].index_select(1, keep), layer.values[b].index_select(1, keep))
                              for layer in cache.layers]

        def reindex(keep_b: torch.Tensor) -> None:
            """Keep batch positions ``keep_b``, in that order (in place: see :func:`_compacted`)."""
            nonlocal mask, act, next_pos, done, first
            for layer in cache.layers:
                layer.keys, layer.values = _compacted(layer.keys, keep_b), _compacted(layer.values, keep_b)
            mask, act, next_pos, done, first = mask[keep_b], act[keep_b], next_pos[keep_b], done[keep_b], first[keep_b]

        t_prefill = time.perf_counter()
        with self._generation_context():
            new_counts = [len(r) - c + x for r, c, x in zip(rows, reuse, extra, strict=True)]
            self.stats["prefill_tokens"] += sum(new_counts)
            if K:
                logits, kept = self._verify(ids, pos, mask, cache, C, new_counts, drafts, K)
                for i, (d, p) in enumerate(zip(drafts, kept, strict=True)):
                    if d is None:
                        continue
                    self.stats["drafted_rows"] += 1
                    self.stats["draft_tokens_kept"] += p
                    out[i, :p] = torch.from_numpy(d[:p])
                    if p == len(d):  # the draft is the completion: the row is done before the first step
                        self.stats["accepted_rows"] += 1
                        n_gen[i], done[i] = len(d), True
                        continue
                    # the row decodes on after the draft's first p tokens: the rest of the draft's keys/values
                    # are not its context
                    off[i] = p
                    next_pos[i] += p
                    mask[i, C + S - extra[i] + p:C + S] = 0
            else:
                logits = self._prefill(ids, pos, mask, cache, C, new_counts)
            t_decode = time.perf_counter()
            self.stats["prefill_s"] += t_decode - t_prefill
            cur = C + S
            # rows by first used column, so that groups of them are leading slices; worth one pass over
            # the cache when the groups save more than that over half the steps
            by_first = torch.argsort(first, stable=True)
            width = cur + max_new_tokens // 2
            plan = decode_groups(first[by_first].tolist(), width)
            saved = B * (width - plan[0][2]) - sum((b - a) * (width - f) + GROUP_COST for a, b, f in plan[1:])
            if worth_reordering(saved, max_new_tokens // 2, B * total) and not bool((by_first == act).all()):
                reindex(by_first)
                logits = logits[by_first]
                groups = plan
            else:
                groups = self._groups(first, width)
            for step in range(max_new_tokens):
                nxt = self._pick(logits, temperature, top_p, gen) if sample else logits.argmax(-1)
                nxt = torch.where(done, torch.full_like(nxt, tok.pad_token_id), nxt)
                live = act[~done]
                out[live, off[live] + step] = nxt[~done]  # a finished row's completion stays (an accepted draft)
                hit = torch.isin(nxt, stop) & ~done
                for b in hit.nonzero().squeeze(-1).tolist():
                    n_gen[int(act[b])] = int(off[act[b]]) + step + 1
                done |= hit | (off[act] + step + 1 >= max_new_tokens)  # a row that a draft started ends sooner
                if bool(done.all()) or step == max_new_tokens - 1:
                    break
                if int(done.sum()) >= max(1, done.numel() // 4):  # compact: finished rows stop costing compute
                    harvest(done.nonzero().squeeze(-1).tolist())
                    keep_b = (~done).nonzero().squeeze(-1)
                    nxt = nxt[keep_b]
                    reindex(keep_b)
                    groups = self._groups(first, cur + 1 + (max_new_tokens - step) // 2)
                mask[:, cur] = (~done).long()
                self.stats["decode_steps"] += 1
                self.stats["row_steps"] += int(act.numel())
                span = _DECODE_SPAN.set((groups, cur + 1))
                try:
                    logits = self._model_forward(cache, input_ids=nxt[:, None], position_ids=next_pos[:, None].clone(),
                                                 attention_mask=mask, spans=groups)[:, -1, :].float()
                finally:
                    _DECODE_SPAN.reset(span)
                cur += 1
                next_pos += 1
            harvest(list(range(act.numel())))
            self.stats["decode_s"] += time.perf_counter() - t_decode

        results: list[tuple[list[int], int]] = []
        for i, r in enumerate(rows):
            gen_ids = out[i, :n_gen[i]].tolist()
            self._store.append(_Entry(ids=np.concatenate([r, np.asarray(gen_ids[:-1], dtype=np.int64)]),
                                      kv=kv_rows[i], used=time.monotonic()))
            results.append((gen_ids, reuse[i]))
        self._evict()
        return [results[k] for k in sorted(range(len(order)), key=order.__getitem__)]  # the caller's order

    @staticmethod
    def _groups(first: torch.Tensor, width: int) -> list[tuple[int, int, int]]:
        """Decode groups for rows whose first used columns are ``first`` (:func:`decode_groups` when
        they are sorted, as after the reordering in :meth:`_decode`; else one group from the earliest)."""
        f = first.tolist()
        return decode_groups(f, width) if f == sorted(f) else [(0, len(f), min(f))]

    def _prefill(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache: Any, C: int,
                 new: list[int]) -> torch.Tensor:
        """Run every row's new tokens (right-aligned in ``ids``' S columns after the C reused ones) and
        return the next-token logits. Rows with fewer new tokens are pads on the left of theirs; one
        long row (a long tool observation) would make the whole batch run its length, so the columns
        run in chunks (:func:`prefill_plan`), each by the sub-batch of rows that have a token there."""
        S = ids.shape[1]
        with _gqa_sdpa():
            logits = self._prefill_chunks(ids, pos, mask, cache, C, new)
        for layer in cache.layers:
            layer.cumulative_length.fill_(C + S)
        assert logits is not None  # the last chunk always runs every row
        return logits[:, -1, :].float()

    def _prefill_chunks(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache: Any, C: int,
                        new: list[int]) -> torch.Tensor | None:
        S = ids.shape[1]
        logits = None
        for a, b, rows in prefill_plan(new, S):
            for layer in cache.layers:  # StaticLayer writes at its own running offset
                layer.cumulative_length.fill_(C + a)
            self.stats["prefill_slots"] += (b - a) * (ids.shape[0] if rows is None else len(rows))
            if rows is None:
                logits = self._model_forward(cache, input_ids=ids[:, a:b], position_ids=pos[:, a:b], attention_mask=mask)
                continue
            m = len(rows)
            if rows != list(range(m)):
                raise AssertionError("prefill sub-batches must be leading rows (_decode orders them)")
            full = [(layer.keys, layer.values) for layer in cache.layers]
            for layer, (k, v) in zip(cache.layers, full, strict=True):
                layer.keys, layer.values = k[:m], v[:m]  # views: written in place
            self._model_forward(cache, input_ids=ids[:m, a:b], position_ids=pos[:m, a:b], attention_mask=mask[:m])
            for layer, (k, v) in zip(cache.layers, full, strict=True):
                layer.keys, layer.values = k, v
        return logits

    def _verify(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache: Any, C: int, new: list[int],
                drafts: list[np.ndarray | None], K: int) -> tuple[torch.Tensor, list[int]]:
        """The prefill of a call with drafts: per row, how many of its draft's leading tokens it keeps
        (all of them: the draft is the completion) and the logits decoding goes on from (after the
        prompt, or after the kept tokens). Columns before the last ``K`` run as :meth:`_prefill` runs
        them; the last ``K`` (every draft and its row's last prompt token) run for all rows, through
        the decoder only; the LM head then runs only where a logit is read, in slices of rows whose
        logits stay under ``VERIFY_LOGIT_BYTES``. A token is kept when the model's argmax there is
        that token by a margin over the runner-up of at least ``DRAFT_MARGINS[dtype]`` logits, and so
        are all before it: a prefill sums in another order than a decode step, and the margin keeps a
        near-tie, which that order could flip, out of what a draft may decide. For the same reason
        decoding goes on only from a logit with that margin: where the first rejected token's is a
        near-tie, the row keeps one token fewer and goes on from the last kept one's logits."""
        B, S = ids.shape
        before = [max(0, n - K) for n in new]  # each row's new tokens left of the last K columns
        with _gqa_sdpa():
            if S > K and any(before):
                self._prefill_chunks(ids[:, :S - K], pos[:, :S - K], mask, cache, C, before)
            for layer in cache.layers:
                layer.cumulative_length.fill_(C + S - K)
            self.stats["prefill_slots"] += B * K
            hidden = self._model_forward(cache, None, input_ids=ids[:, S - K:], position_ids=pos[:, S - K:],
                                         attention_mask=mask)
            for layer in cache.layers:
                layer.cumulative_length.fill_(C + S)
        # the LM head only where a logit is read: a draft's positions, else the prompt's last
        spans = [(K - (1 if d is None else len(d)), K) for d in drafts]
        head = self.model.get_output_embeddings() if self._fused is None else self._fused.logits
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        margin = DRAFT_MARGINS.get(self.dtype, DRAFT_MARGIN_LOW_PRECISION)
        budget = max(K, int(VERIFY_LOGIT_BYTES // (self.model.config.vocab_size * 4)))  # positions a slice of rows
        first: list[torch.Tensor] = []
        kept: list[int] = []
        i = 0
        while i < B:
            j, n = i, 0
            while j < B and (j == i or n + spans[j][1] - spans[j][0] <= budget):
                n += spans[j][1] - spans[j][0]
                j += 1
            logits = head(torch.cat([hidden[r, a:b] for r, (a, b) in zip(range(i, j), spans[i:j], strict=True)])).float()
            if cap:
                logits = torch.tanh(logits / cap) * cap
            at = 0
            for d, (a, b) in zip(drafts[i:j], spans[i:j], strict=True):
                window, at = logits[at:at + b - a], at + b - a  # window[t]: the logits that predict d[t]
                if d is None:
                    first.append(window[0])
                    kept.append(0)
                    continue
                top = window.topk(2, dim=-1)
                sure = top.values[:, 0] - top.values[:, 1] >= margin
                ok = (top.indices[:, 0] == torch.from_numpy(d).to(window.device)) & sure
                p = int(ok.long().cumprod(0).sum())  # leading tokens the model would write itself
                if 0 < p < len(d) and not bool(sure[p]):
                    p -= 1  # decoding goes on from window[p]: only from a logit that a decode step would not flip
                kept.append(p)
                first.append(window[min(p, len(d) - 1)])
            i = j
        return torch.stack(first), kept

    @staticmethod
    def _pick(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
        probs = torch.softmax(logits / temperature, dim=-1)
        if top_p < 1.0:
            sp, si = probs.sort(dim=-1, descending=True)
            keep = sp.cumsum(-1) - sp < top_p
            sp = sp * keep
            probs = torch.zeros_like(probs).scatter_(-1, si, sp)
        return torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=gen).squeeze(-1)
