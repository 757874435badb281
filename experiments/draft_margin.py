"""How far a prefill's logits are from a decode step's over the same tokens, per compute dtype.

Why: an evaluation draft (``CachedHFPolicy._verify``) is checked in one prefill, while decoding would
have produced each token in its own step; the two sum in different orders. ``DRAFT_MARGINS`` (how far
a draft token must lead the runner-up) is set from this gap (docs/experiments.md, Draft margins: the
gap in each dtype). It also prints the share of greedy tokens whose
own lead is under 0.5 and 1 logit: what a margin costs in rejected drafts.

    python experiments/draft_margin.py [--model models/base] [--dtype fp32 bf16]
"""

from __future__ import annotations

import argparse

import torch

from apprentice.envs import FAMILIES
from apprentice.lm import modeling
from apprentice.policies.hf import HFPolicy
from apprentice.policies.oracle import OraclePolicy
from apprentice.rollout.episodes import run_episodes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/base")
    ap.add_argument("--dtype", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    specs = [FAMILIES[f].generate(s, lv) for f in ("grid", "search") for lv in (0, 2) for s in (1, 2)]
    episodes = run_episodes(specs, OraclePolicy(), max_turns=2, progress=False)
    for dtype in args.dtype:
        pol = HFPolicy(args.model, dtype=dtype, chat_template="compact")
        tok = pol.tokenizer
        gaps, leads, flips = [], [], 0
        for t in episodes:  # the prompt of turn 2: after one tool call and its observation
            enc = tok(pol.render(t.messages[:4], t.tools), return_tensors="pt", add_special_tokens=False)
            with modeling.generation(pol.dtype, pol.device):
                g = pol.model.generate(**enc, max_new_tokens=args.new_tokens, do_sample=False, output_scores=True,
                                       return_dict_in_generate=True, pad_token_id=tok.pad_token_id,
                                       eos_token_id=pol.stop_ids, temperature=None, top_p=None, top_k=None)
                n = len(g.scores)
                prefill = pol.model(input_ids=g.sequences[:, :-1]).logits[0, -n:].float()
            decode = torch.stack([s[0].float() for s in g.scores])
            gaps.append((prefill - decode).abs().max(-1).values)
            top = decode.topk(2, -1).values
            leads.append(top[:, 0] - top[:, 1])
            flips += int((prefill.argmax(-1) != decode.argmax(-1)).sum())
        gap, lead = torch.cat(gaps), torch.cat(leads)
        print(f"{dtype}: {len(gap)} greedy tokens; largest |prefill - decode| logit gap per token: max {gap.max():.4g}, "
              f"median {gap.median():.4g}; argmax flips {flips}; tokens leading by < 0.5: {(lead < 0.5).float().mean():.1%}, "
              f"< 1: {(lead < 1).float().mean():.1%}", flush=True)


if __name__ == "__main__":
    main()
