"""The generation engine of every local model: batched HF ``generate`` plus KV-cache reuse across turns.

Why reuse: a multi-turn episode re-sends its whole conversation every turn. ``model.generate``
re-encodes it from scratch (~200 tokens of system prompt and tool schemas, plus every earlier turn),
and on a CPU that prefill costs as much as the decoding itself (batching does not help prefill: it
is already compute-bound at batch size 1). So this policy keeps, per conversation, the keys/values of
everything it has already encoded and only runs the *new* tokens (the tool observation, then the
reply); episodes of one family also share one encoding of their common prefix (system prompt +
tools).

Why decoding is plain ``generate`` (issue M): the engine used to run its own decode loop over a
preallocated ``StaticCache`` with per-step stop checks and batch compaction. Measured side by side
(``bench/generation_engines.py``), that loop was no faster than ``generate`` fed the same cache, and
it crashed under bf16 autocast (the StaticCache was allocated in bf16 while RoPE hands it fp32
keys: ``index_copy_(): self and source expected to have the same dtype``). Here the only hand-written
part is the prefix store (no library keeps a finished request's cache for its next turn on CPU);
each call builds one ``DynamicCache`` from the stored rows and hands it to ``generate``, which runs
the new tokens, samples, stops at the stop tokens and grows the cache in whatever dtypes the model
produces (fp32 keys and bf16 values under bf16 autocast). transformers' continuous batching
(``generate_batch``) keeps no cache between requests and was the slowest candidate on CPU.
vLLM/SGLang do all of this but need a GPU.

Layout of one call: row ``i`` is ``[pad | reused prefix, right-aligned at C | pad | new tokens,
right-aligned at C+S]``; the attention mask has holes where the pads are, and ``generate`` derives
positions from the mask's cumulative sum, so every token sits at its true position.

Correctness: the key/value of position ``p`` depends only on tokens ``<= p``, so reusing them for
an identical token prefix is exact up to floating-point summation order; a test checks that greedy
episodes equal plain one-at-a-time ``generate`` in fp32 and bf16, and ``bench/rollout.py`` checks the
same on real problems. The match is on *token ids* (longest common prefix), so a re-rendered turn
that tokenizes differently from what was generated simply reuses less. Memory is bounded by
``cache_tokens`` (least recently used conversations are dropped).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from apprentice import modeling
from apprentice.policies.base import Message, Turn
from apprentice.policies.hf import HFPolicy
from apprentice.policies.toolcalls import parse_assistant

MIN_SHARED_PREFIX = 16  # tokens; shorter common prefixes are not worth a separate forward pass


@dataclass
class _Entry:
    ids: np.ndarray  # token ids whose keys/values are stored
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (kv_heads, len, head_dim)
    used: float = 0.0
    shared: bool = False  # a common prefix of several conversations: never "superseded"


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.nonzero(a[:n] != b[:n])[0]
    return int(diff[0]) if diff.size else n


class CachedHFPolicy(HFPolicy):
    """Same constructor and outputs as :class:`HFPolicy`; ``cache_tokens`` caps the stored prefixes."""

    def __init__(self, *args: Any, cache_tokens: int = 65536, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cache_tokens = cache_tokens
        self._store: list[_Entry] = []
        cfg = self.model.config
        self._kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self._head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.stats = {"prompt_tokens": 0, "reused_tokens": 0}

    @classmethod
    def from_policy(cls, policy: HFPolicy, **kwargs: Any) -> CachedHFPolicy:
        """The same model, tokenizer and sampling settings as an existing ``HFPolicy`` (``kwargs``
        override any of them, e.g. ``dtype``)."""
        kw: dict[str, Any] = dict(temperature=policy.temperature, top_p=policy.top_p,
                                  max_new_tokens=policy.max_new_tokens, batch_size=policy.batch_size,
                                  dtype=policy.dtype, seed=policy.seed, policy_id=policy.policy_id)
        return cls(policy.model, policy.tokenizer, **{**kw, **kwargs})

    def reset_cache(self) -> None:
        self._store.clear()

    # -- prefix store --------------------------------------------------------------------------
    def _best(self, ids: np.ndarray) -> tuple[_Entry | None, int]:
        best, n = None, 0
        for e in self._store:
            k = _lcp(e.ids, ids)
            if k > n:
                best, n = e, k
        return best, n

    def _evict(self) -> None:
        total = sum(len(e.ids) for e in self._store)
        if total <= self.cache_tokens:
            return
        for e in sorted(self._store, key=lambda e: e.used):
            self._store.remove(e)
            total -= len(e.ids)
            if total <= self.cache_tokens:
                break

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

    def _encode_alone(self, ids: np.ndarray) -> list[tuple[torch.Tensor, torch.Tensor]]:
        from transformers import DynamicCache

        cache: Any = DynamicCache(config=self.model.config)  # Any: its layers' union type lacks .keys
        x = torch.tensor(ids[None, :], device=self.device)
        with torch.inference_mode(), modeling.autocast(self.dtype, self.device):
            self.model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1)
        return [(layer.keys[0].clone(), layer.values[0].clone()) for layer in cache.layers]

    # -- generation ----------------------------------------------------------------------------
    def _generate(self, convs: list[list[Message]], tools: list[list[dict[str, Any]]],
                  temperature: float, top_p: float, max_new_tokens: int) -> list[Turn]:
        from transformers import DynamicCache

        tok = self.tokenizer
        rows = [np.asarray(tok(self.render(c, t), add_special_tokens=False)["input_ids"], dtype=np.int64)
                for c, t in zip(convs, tools, strict=True)]
        hits = [self._best(r)[1] for r in rows]
        self._add_shared_prefixes(rows, hits)
        matches = [self._best(r) for r in rows]
        # reuse at most len-1 tokens: the last prompt token must run to give the next-token logits
        reuse = [min(n, len(r) - 1) if e is not None else 0 for r, (e, n) in zip(rows, matches, strict=True)]
        B, C = len(rows), max(reuse)
        S = max(len(r) - c for r, c in zip(rows, reuse, strict=True))
        # layout per row: [pad | reused prefix (right-aligned to C) | pad | new tokens (right-aligned to C+S)];
        # generate derives positions from the mask (cumsum), so the holes do not shift them
        mask = torch.zeros(B, C + S, dtype=torch.long)
        ids = torch.full((B, C + S), tok.pad_token_id, dtype=torch.long)
        for i, (r, c) in enumerate(zip(rows, reuse, strict=True)):
            ids[i, C - c:C] = torch.from_numpy(r[:c])
            mask[i, C - c:C] = 1
            ids[i, C + S - (len(r) - c):] = torch.from_numpy(r[c:])
            mask[i, C + S - (len(r) - c):] = 1
        cache: Any = DynamicCache(config=self.model.config)
        if C:
            self._fill(cache, matches, reuse, C)
        self.stats["prompt_tokens"] += sum(len(r) for r in rows)
        self.stats["reused_tokens"] += sum(reuse)

        sample = temperature > 0
        gen_kwargs: dict[str, Any] = dict(
            max_new_tokens=max_new_tokens, do_sample=sample, eos_token_id=self.stop_ids,
            pad_token_id=tok.pad_token_id, use_cache=True,
        )
        if sample:
            gen_kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
        else:  # neutralise sampling fields a model's generation_config may carry (avoids warnings)
            gen_kwargs.update(temperature=None, top_p=None, top_k=None)
        self._calls += 1
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(self.seed + self._calls)
            with torch.inference_mode(), modeling.autocast(self.dtype, self.device):
                seqs = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                           cache=cache, **gen_kwargs)
        new = seqs[:, C + S:].tolist()
        full_mask = torch.cat([mask, torch.ones(B, len(new[0]), dtype=torch.long)], dim=1)

        # the new encodings supersede the ones they extended (shared prefixes stay for other episodes)
        used_entries = {id(e) for e, _ in matches if e is not None and not e.shared}
        self._store = [e for e in self._store if id(e) not in used_entries]
        turns: list[Turn] = []
        for i, r in enumerate(rows):
            stop_at = next((k for k, t in enumerate(new[i]) if t in self.stop_ids), None)
            gen_ids = new[i] if stop_at is None else new[i][:stop_at + 1]
            # keep: prompt + reply without its last token (that one was never run through the model)
            keep = full_mask[i].nonzero().squeeze(-1)[: len(r) + len(gen_ids) - 1].to(self.device)
            kv = [(layer.keys[i][:, keep].clone(), layer.values[i][:, keep].clone()) for layer in cache.layers]
            self._store.append(_Entry(ids=np.concatenate([r, np.asarray(gen_ids[:-1], dtype=np.int64)]),
                                      kv=kv, used=time.monotonic()))
            text = tok.decode(gen_ids if stop_at is None else gen_ids[:stop_at], skip_special_tokens=True)
            msg, err = parse_assistant(text)
            turns.append(Turn(message=msg, prompt_tokens=len(r), completion_tokens=len(gen_ids), parse_error=err,
                              raw=text, extra={"finish_reason": "length" if stop_at is None else "stop",
                                               "cached_tokens": reuse[i]}))
        self._evict()
        return turns

    def _fill(self, cache: Any, matches: list[tuple[_Entry | None, int]], reuse: list[int], C: int) -> None:
        """Put each row's reused keys/values right-aligned at ``[C - c, C)`` of a fresh batch cache.
        Stored tensors keep the dtypes the model produced them in (under bf16 autocast: fp32 keys
        after RoPE, bf16 values), so the cache continues exactly as if it had encoded them now."""
        ref = next(e for e, _ in matches if e is not None).kv
        B = len(matches)
        for li, (k0, v0) in enumerate(ref):
            keys = k0.new_zeros((B, self._kv_heads, C, self._head_dim))
            values = v0.new_zeros((B, self._kv_heads, C, self._head_dim))
            for i, ((e, _), c) in enumerate(zip(matches, reuse, strict=True)):
                if c:
                    k, v = e.kv[li]  # type: ignore[union-attr]
                    keys[i, :, C - c:] = k[:, :c]
                    values[i, :, C - c:] = v[:, :c]
            cache.update(keys, values, li)
        for e, c in zip((e for e, _ in matches), reuse, strict=True):
            if c:
                e.used = time.monotonic()  # type: ignore[union-attr]
