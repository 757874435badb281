"""Benchmark: generation speed as a share of this machine's peak, measured in the same run.

Prints the machine's peak first (large GEMMs through torch in bf16 and fp32, and read bandwidth),
then for each candidate engine, on the same first-turn token ids:

* prefill tokens/s over every prompt (one call, one new token) and its share of the dtype's peak;
* decode tokens/s at batch 1, 16 and 64 (every row decodes the same number of steps: stop ids are
  ignored) and its share of the peak; at batch 1 also the share of read bandwidth, which is what
  bounds a one-row step (every weight is read once for one token).

The FLOPs of a token come from the model's config: the linear layers (2 x parameters), the LM head
where a position's logits are computed (every decode step, the last prompt token of a prefill), and
attention (4 x layers x heads x head_dim per token of context). Each prompt starts with a few tokens
of its own, so no engine can serve one prompt's prefix from another's (a raw prefill, not a cache hit).

Candidates: ``engine`` (``CachedHFPolicy`` in the run's dtype: bf16 weight copies with fused
projections where the dtype is bf16), ``autocast`` (the same engine on the transformers model under
bf16 autocast, fp32 weights), ``fp32`` (the engine in fp32), and ``vllm`` when ``--vllm-url`` names a
running vLLM OpenAI-compatible server of the same model (its ``/v1/completions`` with token ids as
the prompt; started with ``VLLM_SERVER_DEV_MODE=1`` its prefix cache is reset before each figure).
Decode tokens/s: ``N`` steps over their time, by the engine's own decode clock (for vLLM, the
difference of two calls, ``1 + N`` and ``1`` new tokens).

    python bench/engine_peak.py                      # all local candidates, batches 1 16 64
    python bench/engine_peak.py --quick              # what `make bench` runs: 16 prompts, batches 1 16
    python bench/engine_peak.py --vllm-url http://127.0.0.1:8011 --vllm-model base

On a shared machine the absolute numbers move (each timing is the fastest of ``--repeats``); compare the
columns of one run.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from generation_engines import first_turns  # noqa: E402  (bench/generation_engines.py)
from rollout import problems  # noqa: E402  (bench/rollout.py)

from apprentice.lm import modeling  # noqa: E402
from apprentice.policies.hf_cached import CachedHFPolicy  # noqa: E402


def gemm_peak(dtype: torch.dtype, n: int = 4096, reps: int = 3) -> float:
    """GFLOP/s of the best of ``reps`` n x n x n matmuls (after a warm-up)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = max(best, 2 * n ** 3 / (time.perf_counter() - t) / 1e9)
    return best


def read_bandwidth(mb: int = 1024, reps: int = 3) -> float:
    """GB/s of the best of ``reps`` reductions over a ``mb`` MB fp32 tensor (read once each)."""
    x = torch.ones(mb * 2 ** 20 // 4)
    x.sum()
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return best


class Cost:
    """FLOPs and bytes of SmolLM2-like (Llama-architecture) tokens, from the model's config."""

    def __init__(self, cfg: Any) -> None:
        h, layers, inter, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        d = getattr(cfg, "head_dim", None) or h // heads
        per_layer = h * heads * d * 2 + 2 * h * kv * d + 3 * h * inter  # q, o, k, v, gate/up/down
        self.linear = 2 * layers * per_layer
        self.head = 2 * h * vocab
        self.attn_per_ctx = 4 * layers * heads * d
        self.params = layers * per_layer + h * vocab  # the head is the (tied) embedding
        self.kv_per_ctx = 2 * layers * kv * d  # elements of keys + values per token of context

    def prefill(self, length: int) -> float:
        """FLOPs of a prompt of ``length`` tokens (causal attention: mean context length / 2)."""
        return length * (self.linear + self.attn_per_ctx * length / 2) + self.head

    def decode(self, ctx: float) -> float:
        return self.linear + self.head + self.attn_per_ctx * ctx


class Local:
    """A ``CachedHFPolicy`` variant as a candidate."""

    def __init__(self, model: Any, tok: Any, dtype: str, fused: bool) -> None:
        self.pol = CachedHFPolicy(model, tok, batch_size=64, dtype=dtype)
        self.pol.fused = self.pol.fused and fused
        self.pol.stop_ids = [-1]  # every row decodes every step

    def run(self, prompts: list[list[int]], new: int) -> float:
        self.pol.reset_cache()
        t = time.perf_counter()
        self.pol.complete_ids(prompts, max_new_tokens=new, temperature=0.0)
        return time.perf_counter() - t

    def decode(self, prompts: list[list[int]], steps: int) -> float:
        """Seconds of ``steps`` decode steps over ``prompts`` (the engine's own decode clock: no prefill)."""
        s = self.pol.stats
        before = s["decode_s"]
        self.run(prompts, 1 + steps)
        return s["decode_s"] - before


class Vllm:
    """A vLLM OpenAI-compatible server as a candidate (concurrent /v1/completions requests)."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url.rstrip("/"), model

    def _post(self, path: str, body: dict[str, Any] | None) -> Any:
        req = urllib.request.Request(self.url + path, data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read() or b"{}")

    def run(self, prompts: list[list[int]], new: int) -> float:
        with contextlib.suppress(Exception):  # without dev mode a cache hit only makes vLLM look faster
            self._post("/reset_prefix_cache", None)
        body = {"model": self.model, "max_tokens": new, "temperature": 0.0, "ignore_eos": True}
        t = time.perf_counter()
        with cf.ThreadPoolExecutor(len(prompts)) as ex:
            list(ex.map(lambda p: self._post("/v1/completions", {**body, "prompt": p}), prompts))
        return time.perf_counter() - t

    def decode(self, prompts: list[list[int]], steps: int) -> float:
        """Seconds of ``steps`` decode steps: a call of ``1 + steps`` new tokens less one of ``1``."""
        return self.run(prompts, 1 + steps) - self.run(prompts, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "base"))
    ap.add_argument("--candidates", nargs="+", default=["engine", "autocast", "fp32"],
                    choices=["engine", "autocast", "fp32"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--prompts", type=int, default=64, help="first-turn prompts for prefill (and the largest batch)")
    ap.add_argument("--steps", type=int, default=32, help="decode steps a decode figure times")
    ap.add_argument("--repeats", type=int, default=2, help="each timing is the fastest of this many (a shared machine)")
    ap.add_argument("--vllm-url", default="", help="a running vLLM server of the same model (adds a `vllm` column)")
    ap.add_argument("--vllm-model", default="", help="the model name that server serves (default: --model)")
    ap.add_argument("--quick", action="store_true", help="16 prompts, batches 1 and 16, 16 steps, engine and autocast")
    ap.add_argument("--json", default="", help="also write the figures to this JSON file")
    a = ap.parse_args()
    if a.quick:
        a.prompts, a.batches, a.steps, a.candidates, a.repeats = 16, [1, 16], 16, ["engine", "autocast"], 1
    if not (Path(a.model) / "config.json").exists():
        print(f"error: {a.model} holds no model; run `python -m apprentice prepare-base` first", file=sys.stderr)
        return 2
    bf16, fp32, bw = gemm_peak(torch.bfloat16), gemm_peak(torch.float32), read_bandwidth()
    peak = {"bf16": bf16, "fp32": fp32}
    print(f"machine: {torch.get_num_threads()} threads; peak (torch GEMM 4096^3): bf16 {bf16:.0f} GFLOP/s, "
          f"fp32 {fp32:.0f} GFLOP/s; read bandwidth {bw:.1f} GB/s", flush=True)

    tok = modeling.load_tokenizer(a.model, "compact")
    model = modeling.load_model(a.model, device="cpu")
    cost = Cost(model.config)
    convs, tools = first_turns(problems(a.prompts))
    base = [tok(tok.apply_chat_template(c, tools=t, add_generation_prompt=True, tokenize=False),
                add_special_tokens=False)["input_ids"] for c, t in zip(convs, tools, strict=True)]
    prompts = [tok(f"#{i}\n", add_special_tokens=False)["input_ids"] + p for i, p in enumerate(base)]
    mean_len = sum(map(len, prompts)) / len(prompts)
    print(f"model {a.model}: {cost.linear / 1e6:.0f} MFLOP/token in linear layers, +{cost.head / 1e6:.0f} LM head, "
          f"+{cost.attn_per_ctx / 1e3:.0f} kFLOP per token of context; {len(prompts)} prompts of "
          f"{mean_len:.0f} tokens on average; decode figures over {a.steps} steps", flush=True)

    cands: dict[str, tuple[Any, str]] = {}
    for c in a.candidates:
        dt = "fp32" if c == "fp32" else "bf16"
        cands[c] = (Local(model, tok, dt, fused=c == "engine"), dt)
    if a.vllm_url:
        cands["vllm"] = (Vllm(a.vllm_url, a.vllm_model or a.model), "bf16")
    for eng, _ in cands.values():  # warm-up: kernel selection, buffers
        eng.run(prompts[:2], 2)

    results: dict[str, dict[str, Any]] = {c: {} for c in cands}

    def best(eng: Any, rows: list[list[int]], new: int) -> float:
        return min(eng.run(rows, new) for _ in range(max(1, a.repeats)))

    prefill_flop = sum(cost.prefill(len(p)) for p in prompts)
    for c, (eng, dt) in cands.items():
        t = best(eng, prompts, 1)
        results[c]["prefill_tok_s"] = sum(map(len, prompts)) / t
        results[c]["prefill_share"] = prefill_flop / t / 1e9 / peak[dt]
    for b in a.batches:
        rows = prompts[:b]
        ctx = sum(map(len, rows)) / len(rows) + a.steps / 2
        for c, (eng, dt) in cands.items():  # interleaved, so machine load hits every candidate alike
            rate = b * a.steps / max(min(eng.decode(rows, a.steps) for _ in range(max(1, a.repeats))), 1e-9)
            results[c][f"decode{b}_tok_s"] = rate
            results[c][f"decode{b}_share"] = rate * cost.decode(ctx) / 1e9 / peak[dt]
            if b == 1:
                step_bytes = cost.params * (2 if dt == "bf16" else 4) + cost.kv_per_ctx * ctx * 2
                results[c]["decode1_bw_share"] = rate * step_bytes / 1e9 / bw

    print(f"\n{'':>22}" + "".join(f"{c:>18}" for c in cands))
    print(f"{'prefill tok/s (share)':>22}" + "".join(
        f"{r['prefill_tok_s']:10.0f} ({100 * r['prefill_share']:3.0f} %)" for r in results.values()))
    for b in a.batches:
        print(f"{f'decode b={b} tok/s':>22}" + "".join(
            f"{r[f'decode{b}_tok_s']:10.1f} ({100 * r[f'decode{b}_share']:3.0f} %)" for r in results.values()))
    if 1 in a.batches:
        print(f"{'b=1 share of read bw':>22}" + "".join(f"{100 * r['decode1_bw_share']:15.0f} %  "
                                                       for r in results.values()))
    print("(share: of the dtype's GEMM peak above; bf16 for engine/autocast/vllm, fp32 for fp32)")
    if a.json:
        Path(a.json).write_text(json.dumps({"peak_gflops": peak, "read_gb_s": bw, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
