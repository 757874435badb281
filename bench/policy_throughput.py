"""HFPolicy decode throughput at batch 1 vs batch N (greedy, fixed new-token budget).

``python bench/policy_throughput.py [--model models/base] [--batch 16] [--new 64] [--dtype auto] [--threads N]``
Prints generated tokens/s for one conversation at a time and for N at once, and the ratio.
"""

from __future__ import annotations

import argparse
import time

import torch

from apprentice.policies.hf import HFPolicy

QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "How many legs has a spider?",
             "Explain photosynthesis briefly.", "What is 17 times 3?", "Who wrote Hamlet?",
             "Give me a synonym for happy.", "Why is the sky blue?"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="models/base")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    pol = HFPolicy(a.model, max_new_tokens=a.new, batch_size=a.batch, dtype=a.dtype)
    convs = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(a.batch)]
    pol.act(convs[:2], [[]] * 2)  # warm-up
    print(f"model={a.model} dtype={pol.dtype} new_tokens={a.new} threads={torch.get_num_threads()}")
    t = time.perf_counter()
    single = [pol.act([c], [[]])[0] for c in convs[:4]]
    dt1 = time.perf_counter() - t
    tok1 = sum(x.completion_tokens for x in single)
    t = time.perf_counter()
    batch = pol.act(convs, [[]] * len(convs))
    dtn = time.perf_counter() - t
    tokn = sum(x.completion_tokens for x in batch)
    print(f"batch 1 : {tok1} tokens in {dt1:.1f}s = {tok1 / dt1:.1f} tok/s "
          f"(prompt ~{single[0].prompt_tokens} tokens)")
    print(f"batch {a.batch}: {tokn} tokens in {dtn:.1f}s = {tokn / dtn:.1f} tok/s")
    print(f"ratio: {(tokn / dtn) / (tok1 / dt1):.1f}x")


if __name__ == "__main__":
    main()
