"""Benchmark: fp32 vs bf16 autocast on this machine, for generation and for an SFT step, side by side.

Prints, in one run (A-B-B-A order, so drift on a shared machine hits both sides alike):

1. the machine (CPU model, AMX / AVX512-BF16 flags, threads) and what ``dtype: auto`` resolves to here
   (:mod:`apprentice.lm.dtypes`: a measured probe, cached per machine);
2. **generation**: the rollout engine (KV reuse across turns) on the same multi-turn episodes, greedy,
   in each dtype: tokens/s, and how many episodes took the same actions in both;
3. **SFT**: the stage's trainer for ``--steps`` steps on the default profile's SFT set, in each dtype:
   seconds per step and the loss of every step (same seed, same batches);
4. its last lines: ``generation bf16/fp32`` and ``sft bf16/fp32`` speed ratios, and whether the results stay
   within tolerance (the first SFT step's loss within 2 %: same weights, same batch, only the forward's
   precision differs; later steps follow bf16-rounded gradients and drift further, so
   they are printed, not gated; the same greedy actions in >= 75 % of episodes: bf16 rounds
   differently, so a near-tie between two tokens can flip, which the evaluation's CI absorbs).

    python bench/dtype.py                 # models/base (the 135M), 16 episodes, 2 SFT steps per run
    python bench/dtype.py --quick         # the tiny model: a smoke check of both paths

Needs ``models/base`` (``python -m apprentice prepare-base``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from train_throughput import sft_records, train  # noqa: E402

from apprentice.config import load_config  # noqa: E402
from apprentice.lm import dtypes  # noqa: E402
from apprentice.lm.modeling import load_tokenizer  # noqa: E402

SFT_LOSS_REL_TOL = 0.02
SAME_ACTIONS_MIN = 0.75


def generation(model_dir: str, dtype: str, n: int, max_new_tokens: int) -> dict[str, Any]:
    from apprentice.envs import FAMILIES
    from apprentice.policies.hf import HFPolicy
    from apprentice.policies.hf_cached import CachedHFPolicy
    from apprentice.rollout.episodes import run_episodes

    specs = [FAMILIES[f].generate(1000 + i, i % 3) for i in range(n // 2) for f in ("grid", "search")]
    pol = CachedHFPolicy.from_policy(HFPolicy(model_dir, max_new_tokens=max_new_tokens, batch_size=n, dtype=dtype))
    t0 = time.perf_counter()
    trajs = run_episodes(specs, pol, max_turns=3, progress=False)
    wall = time.perf_counter() - t0
    toks = sum(t.completion_tokens for t in trajs)
    actions = [json.dumps([m.get("tool_calls") or m.get("content") for m in t.messages if m["role"] == "assistant"],
                          sort_keys=True, default=str) for t in trajs]
    return {"wall_s": wall, "tokens": toks, "tok_s": toks / wall, "actions": actions}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the quick profile's tiny model")
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--steps", type=int, default=2, help="SFT steps per run (4 runs)")
    args = ap.parse_args()
    cfg = load_config(ROOT / "params.yaml", "quick" if args.quick else None)
    model_dir = str(ROOT / cfg.model.base)
    if not (Path(model_dir) / "config.json").exists():
        print(f"error: {model_dir} holds no model; run `python -m apprentice prepare-base` first", file=sys.stderr)
        return 2
    import torch

    flags = dtypes.cpu_flags()
    print(f"machine: {dtypes.cpu_model()}; AMX: {'yes' if 'amx_bf16' in flags else 'no'}, AVX512-BF16: "
          f"{'yes' if 'avx512_bf16' in flags else 'no'}; torch threads {torch.get_num_threads()}")
    print(dtypes.cpu_auto().line())

    order = ("fp32", "bf16", "bf16", "fp32")
    gens: dict[str, list[dict[str, Any]]] = {"fp32": [], "bf16": []}
    for d in order:
        gens[d].append(generation(model_dir, d, args.episodes, args.max_new_tokens))
    gen = {d: {"tok_s": sum(r["tokens"] for r in rs) / sum(r["wall_s"] for r in rs), "actions": rs[0]["actions"]}
           for d, rs in gens.items()}
    same = sum(a == b for a, b in zip(gen["fp32"]["actions"], gen["bf16"]["actions"], strict=True))
    n_ep = len(gen["fp32"]["actions"])
    print(f"\ngeneration ({n_ep} episodes x 3 turns, greedy, {args.max_new_tokens} new tokens, {model_dir}):")
    for d in ("fp32", "bf16"):
        print(f"  {d}: {gen[d]['tok_s']:7.1f} tok/s")
    print(f"  same actions in both dtypes: {same}/{n_ep}")

    tok = load_tokenizer(model_dir, cfg.model.chat_template)
    records = sft_records(cfg, "")
    sfts: dict[str, list[dict[str, Any]]] = {"fp32": [], "bf16": []}
    for d in order:
        c = cfg.model_copy(update={"model": cfg.model.model_copy(update={"dtype": d})})
        sfts[d].append(train("ours", c, records, tok, args.steps, model_dir))
    sft = {d: {"s_step": sum(r["wall_s"] for r in rs) / (len(rs) * args.steps), "loss": rs[0]["loss"]}
           for d, rs in sfts.items()}
    print(f"\nSFT ({args.steps} steps per run, batch {cfg.sft.batch_size}, {len(records)} records):")
    for d in ("fp32", "bf16"):
        print(f"  {d}: {sft[d]['s_step']:6.2f} s/step  loss {[round(x, 4) for x in sft[d]['loss']]}")
    # step 1 only: in bf16 the second step starts from weights a bf16 update moved
    first, last = (abs(sft["fp32"]["loss"][i] - sft["bf16"]["loss"][i]) / max(abs(sft["fp32"]["loss"][i]), 1e-9)
                   for i in (0, -1))
    print(f"  SFT loss apart: step 1 {100 * first:.2f} %, step {len(sft['fp32']['loss'])} {100 * last:.2f} %")
    ok = first <= SFT_LOSS_REL_TOL and same / n_ep >= SAME_ACTIONS_MIN
    print(f"\ngeneration bf16/fp32 {gen['bf16']['tok_s'] / gen['fp32']['tok_s']:.2f}")
    print(f"sft bf16/fp32 {sft['fp32']['s_step'] / sft['bf16']['s_step']:.2f}")
    print(f"within tolerance: {ok} (SFT step-1 loss {100 * first:.2f} % apart, <= {100 * SFT_LOSS_REL_TOL:.0f} %; "
          f"same actions {same}/{n_ep}, >= {100 * SAME_ACTIONS_MIN:.0f} %)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
