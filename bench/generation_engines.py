"""Benchmark: which generation engine the pipeline keeps, measured on the machine it runs on.

Candidates, every one greedy on the same prompts, in the same compute dtype (fp32, and bf16: autocast
with fp32 weights for the ``generate`` candidates, the engine's fused bf16 weight copies for ``engine``,
which is what ``model.dtype: bf16`` runs; ``bench/engine_peak.py`` compares those two directly):

* ``generate``   -- plain batched HF ``generate``, left padding, every turn re-encoded
                    (``HFPolicy``; what TRL's GRPO sampling does by default);
* ``generate+kv``-- the same ``generate`` call fed each conversation's keys/values from its earlier
                    turns (and one encoding of each family's system prompt + tools), so a turn only
                    runs its new tokens (``GenerateKVPolicy`` below: the library way to reuse);
* ``engine``     -- ``CachedHFPolicy``, the pipeline's engine: the same prefix store, decoded by its
                    own loop over a preallocated ``StaticCache`` that drops finished rows from the
                    batch (its margin over ``generate+kv`` is what keeps it hand-written);
* ``continuous`` -- transformers' continuous batching (``generate_batch``, paged attention over
                    ``sdpa``), the backend of TRL's ``use_transformers_paged``; it keeps no cache
                    between turns.

Part 1 prints generated tokens/s at batch 1, 8 and 32 (first turns of real problems; every batch
size runs its candidates interleaved, so machine load hits all of them alike) and each candidate's
ratio to plain ``generate`` at the same batch size. Part 2 plays whole
episodes (``--episodes`` problems, ``--max-turns`` turns) with each candidate and with the naive
loop of ``bench/rollout.py`` (one episode at a time, one ``generate`` per turn) and prints each
candidate's wall-clock ratio vs naive and whether its actions equal naive's.

    python bench/generation_engines.py                       # fp32 and bf16
    python bench/generation_engines.py --dtypes fp32 --batches 1 8 --episodes 8   # smaller
    python bench/generation_engines.py --quick               # what `make bench` runs: fp32, batch 8,
                                                             # 8 prompts, 4 episodes

On a shared machine the absolute numbers move; compare the columns of one run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from rollout import NaivePolicy, actions, problems  # noqa: E402  (bench/rollout.py)

from apprentice.envs import FAMILIES  # noqa: E402
from apprentice.lm import modeling  # noqa: E402
from apprentice.policies.base import Message, Turn  # noqa: E402
from apprentice.policies.hf import HFPolicy  # noqa: E402
from apprentice.policies.hf_cached import CachedHFPolicy, _Entry  # noqa: E402
from apprentice.policies.toolcalls import parse_assistant  # noqa: E402
from apprentice.rollout.episodes import run_episodes  # noqa: E402


class GenerateKVPolicy(CachedHFPolicy):
    """The engine's prefix store, decoding through plain ``generate`` fed a ``DynamicCache`` built
    from the stored rows (the library alternative to the engine's own loop; bench only). Positions
    come from the attention mask's cumulative sum, so the holes of the layout do not shift them."""

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
            with modeling.generation(self.dtype, self.device):
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


class ContinuousPolicy(HFPolicy):
    """transformers' continuous batching (``generate_batch``) behind the policy protocol (greedy)."""

    def _generate(self, convs, tools, temperature, top_p, max_new_tokens):
        from transformers import GenerationConfig

        tok = self.tokenizer
        prompts = [tok(self.render(c, t), add_special_tokens=False)["input_ids"] for c, t in zip(convs, tools, strict=True)]
        cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=self.stop_ids,
                               pad_token_id=tok.pad_token_id)
        with modeling.generation(self.dtype, self.device):
            res = self.model.generate_batch(inputs=prompts, generation_config=cfg, progress_bar=False)
        outs = [res[k] for k in sorted(res, key=lambda k: int(str(k).rsplit("_", 1)[-1]))]
        turns = []
        for p, o in zip(prompts, outs, strict=True):
            ids = list(o.generated_tokens)
            stop_at = next((k for k, t in enumerate(ids) if t in self.stop_ids), None)
            text = tok.decode(ids if stop_at is None else ids[:stop_at], skip_special_tokens=True)
            msg, err = parse_assistant(text)
            turns.append(Turn(message=msg, prompt_tokens=len(p), completion_tokens=len(ids) if stop_at is None
                              else stop_at + 1, parse_error=err, raw=text))
        return turns


CANDIDATES = {"generate": HFPolicy, "generate+kv": GenerateKVPolicy, "engine": CachedHFPolicy,
              "continuous": ContinuousPolicy}


def first_turns(specs: list[Any]) -> tuple[list[Any], list[Any]]:
    convs, tools = [], []
    for s in specs:
        env = FAMILIES[s.family]()
        first = env.reset(spec=s)
        convs.append([{"role": "system", "content": env.system_prompt}, {"role": "user", "content": first}])
        tools.append(type(env).tool_schemas())
    return convs, tools


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "base"))
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--prompts", type=int, default=32, help="prompts per batch size (batch 1 runs min(this, 4))")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--episodes", type=int, default=16, help="problems for the episode ratio (0 = skip part 2)")
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--episode-candidates", nargs="+", default=["generate", "generate+kv", "engine"], choices=list(CANDIDATES),
                    help="candidates of part 2 (continuous batching is left out by default: slowest in part 1)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="fp32 only, batch 8, 8 prompts, 4 episodes (overrides those four options: "
                         "continuous batching at batch 1 is the slowest cell of part 1)")
    a = ap.parse_args()
    if a.quick:
        a.dtypes, a.batches, a.prompts, a.episodes = ["fp32"], [8], 8, 4
    if a.threads:
        torch.set_num_threads(a.threads)
    if not (Path(a.model) / "config.json").exists():
        print(f"error: {a.model} holds no model; run `python -m apprentice prepare-base` first", file=sys.stderr)
        return 2
    tok = modeling.load_tokenizer(a.model, "compact")
    model = modeling.load_model(a.model, device="cpu")
    specs = problems(max(a.prompts, a.episodes))
    convs, tools = first_turns(specs[:a.prompts])
    print(f"model {a.model}, {torch.get_num_threads()} threads, greedy, {a.new_tokens} new tokens, "
          f"{a.prompts} first-turn prompts, episodes: {a.episodes} problems x {a.max_turns} turns", flush=True)
    for dt in a.dtypes:
        print(f"\n== {dt}: generated tokens/s (first turns) ==", flush=True)
        print(f"{'batch':>5} " + " ".join(f"{c:>11}" for c in a.candidates), flush=True)
        for b in a.batches:
            n = min(a.prompts, 4) if b == 1 else a.prompts
            rates: dict[str, float] = {}
            for c in a.candidates:
                pol = CANDIDATES[c](model, tok, max_new_tokens=a.new_tokens, batch_size=b, dtype=dt)
                pol.act(convs[:1], tools[:1])  # warm-up (and continuous batching's manager start)
                if isinstance(pol, CachedHFPolicy):
                    pol.reset_cache()
                t = time.perf_counter()
                try:
                    out = pol.act(convs[:n], tools[:n])
                    rates[c] = sum(x.completion_tokens for x in out) / (time.perf_counter() - t)
                except Exception as e:  # noqa: BLE001 - a candidate that cannot run says why, the others go on
                    print(f"  {c} failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
            print(f"{b:>5} " + " ".join(f"{rates[c]:11.1f}" if c in rates else f"{'failed':>11}"
                                        for c in a.candidates), flush=True)
            if rates.get("generate"):
                print("      vs generate: " + ", ".join(f"{c} {r / rates['generate']:.2f}x" for c, r in rates.items()
                                                     if c != "generate"), flush=True)
        if not a.episodes:
            continue
        ep = specs[:a.episodes]
        print(f"\n== {dt}: {a.episodes} episodes vs naive (one episode at a time, one generate per turn) ==", flush=True)
        stop_ids = HFPolicy(model, tok, dtype=dt).stop_ids
        naive = NaivePolicy(model, tok, a.new_tokens, modeling.resolve_dtype(dt), stop_ids)
        t = time.perf_counter()
        slow = [run_episodes([s], naive, max_turns=a.max_turns, batch_size=1, progress=False)[0] for s in ep]
        t_naive = time.perf_counter() - t
        print(f"{'naive':>11} {t_naive:8.1f} s", flush=True)
        for c in a.episode_candidates:
            pol = CANDIDATES[c](model, tok, max_new_tokens=a.new_tokens, batch_size=64, dtype=dt)
            t = time.perf_counter()
            try:
                fast = run_episodes(ep, pol, max_turns=a.max_turns, batch_size=64, progress=False)
            except Exception as e:  # noqa: BLE001
                print(f"{c:>11} failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            dt_c = time.perf_counter() - t
            same = sum(actions(x) == actions(y) for x, y in zip(fast, slow, strict=True))
            print(f"{c:>11} {dt_c:8.1f} s  {t_naive / dt_c:5.2f}x naive  identical actions {same}/{len(ep)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
