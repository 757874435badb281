"""Held-out teacher NLL: how well a model predicts the assistant turns of trajectories it never trained on.

Why: a 40-problem greedy benchmark has a Wilson half-width of ~15 points, so it cannot tell whether
one SFT run lost ground against another; the mean NLL over a few thousand supervised tokens of
held-out teacher trajectories can (it moves smoothly with the weights). ``experiments/continue_sft.py``
tracks it along a continued SFT run, and the loop-rule tests use it as the "did continuing lose more
than noise" criterion. Same tokens the SFT loss reads (the chat template's ``{% generation %}``
markers, i.e. assistant turns only), same objective (token-mean NLL).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def supervised_ids(tokenizer: Any, record: dict[str, Any]) -> tuple[list[int], list[int]]:
    """(input ids, assistant mask) of one conversational record, as the SFT loss sees it."""
    out = tokenizer.apply_chat_template(record["messages"], tools=record.get("tools") or None, tokenize=True,
                                        return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


@torch.no_grad()
def heldout_nll(model: Any, tokenizer: Any, records: Sequence[dict[str, Any]], max_length: int = 768) -> dict[str, float]:
    """Token-mean NLL and top-1 accuracy over the assistant tokens of ``records`` (one at a time: exact, no padding)."""
    was_training = model.training
    model.eval()
    total, n, correct = 0.0, 0, 0
    device = next(model.parameters()).device
    for r in records:
        ids, mask = supervised_ids(tokenizer, r)
        ids, mask = ids[:max_length], mask[:max_length]
        if sum(mask[1:]) == 0:
            continue
        x = torch.tensor([ids], device=device)
        logits = model(input_ids=x).logits[0, :-1].float()
        tgt = x[0, 1:]
        m = torch.tensor(mask[1:], device=device, dtype=torch.bool)
        logp = torch.log_softmax(logits[m], dim=-1)
        total += float(-logp.gather(1, tgt[m][:, None]).sum())
        correct += int((logits[m].argmax(-1) == tgt[m]).sum())
        n += int(m.sum())
    model.train(was_training)
    if n == 0:
        raise ValueError("no supervised (assistant) tokens in the held-out records; pass conversations with "
                         "assistant turns")
    return {"nll": total / n, "accuracy": correct / n, "tokens": float(n)}
