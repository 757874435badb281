"""GRPO's micro-batch scored as one flattened row without padding, its rows' common prompt prefix once
(:class:`apprentice.training.packing.SharedPromptScoring`), gives TRL's own log-probabilities, entropies
and gradients (pinned TRL's ``_get_per_token_logps_and_entropies`` on the padded block)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch


def _block(tok, lengths, left_pad, tasks=None):
    """TRL's layout: each row's prompt (left-padded to the longest, plus ``left_pad``) before its
    completion (right-padded). ``tasks``: each row's user message (default: one for all)."""
    tasks = tasks or ["Move the agent from (0, 0) to the goal at (2, 3) without hitting walls."] * len(lengths)
    prompts = [tok.apply_chat_template([{"role": "system", "content": "You solve grid problems with the tools given."},
                                        {"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"] for t in tasks]
    gen = torch.Generator().manual_seed(0)
    K = max(lengths)
    rows = len(lengths)
    P = max(len(p) for p in prompts) + left_pad
    ids = torch.full((rows, P + K), tok.pad_token_id)
    mask = torch.zeros(rows, P + K, dtype=torch.long)
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        ids[i, P - len(p):P] = torch.tensor(p)
        mask[i, P - len(p):P] = 1
        ids[i, P:P + n] = torch.randint(100, 5000, (n,), generator=gen)
        mask[i, P:P + n] = 1
    return ids, mask, K


TASKS = ["Move the agent from (0, 0) to the goal at (2, 3) without hitting walls.", "Find the key, then the door.",
         "Move the agent from (1, 1) to the goal at (4, 0).", "Reach (3, 3)."]


@pytest.mark.parametrize(("left_pad", "tasks"), [(0, None), (3, None), (0, TASKS)])
def test_flat_rows_over_a_shared_prefix_give_trls_logps_entropies_and_gradients(tiny_model_dir, left_pad, tasks):
    """One prompt for all rows, one left-padded, and four prompts (TRL shuffles a generation batch before
    cutting micro-batches): the common system prompt is shared, the rest of each prompt is its row's."""
    from trl import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    from apprentice.lm.modeling import load_model, load_tokenizer
    from apprentice.training.packing import SharedPromptScoring, shared_prompt_row

    tok = load_tokenizer(tiny_model_dir, "compact")
    ids, mask, K = _block(tok, [5, 12, 9, 0], left_pad, tasks)  # the last completion: all masked out
    row = shared_prompt_row(ids, mask, K)
    assert row is not None and row["shared_prefix"] >= 16
    assert row["input_ids"].shape[1] < int(mask.sum())  # no padding, the common prefix once

    class Scorer(SharedPromptScoring, GRPOTrainer):  # only the scoring method runs: no trainer is built
        pass

    got = []
    for share in (False, True):
        model = load_model(tiny_model_dir, dtype="fp32")
        add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
        scorer = object.__new__(Scorer)
        scorer.accelerator = SimpleNamespace(autocast=contextlib.nullcontext, is_main_process=True)
        scorer.share_prompt = share
        logps, ent, _ = scorer._get_per_token_logps_and_entropies(model, ids, mask, K, batch_size=2,
                                                                  compute_entropy=True)
        (logps * torch.linspace(0.5, 1.5, K)).sum().backward()
        got.append((logps.detach(), ent, [p.grad for p in model.parameters()]))
    (ref, ref_ent, ref_grads), (ours, ours_ent, grads) = got
    assert ref.shape == ours.shape == (4, K) and bool((ours[mask[:, -K:] == 0] == 0).all())  # padding scores 0
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_ent, ref_ent, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_blocks_trl_did_not_build_are_left_to_trl_and_unrelated_prompts_share_nothing(tiny_model_dir):
    from apprentice.lm.modeling import load_tokenizer
    from apprentice.training.packing import shared_prompt_row

    tok = load_tokenizer(tiny_model_dir, "compact")
    ids, mask, K = _block(tok, [4, 6], 0)
    one = shared_prompt_row(ids[:1], mask[:1], K)
    assert one is not None and "shared_prefix" not in one  # one row: flattened, nothing to share
    other = ids.clone()
    other[1, :5] = torch.arange(5) + 7  # prompts differ from the first token
    assert "shared_prefix" not in shared_prompt_row(other, mask, K)
    holes = mask.clone()
    holes[1, -K + 1] = 0  # a completion with a hole: not one run
    assert shared_prompt_row(ids, holes, K) is None


@pytest.mark.parametrize("setup", ["eager", "checkpointing"])
def test_a_model_that_would_attend_without_varlen_sdpa_is_scored_by_trl(tiny_model_dir, monkeypatch, setup):
    """Another attention implementation would take the segments but not the shared prefix, and gradient
    checkpointing recomputes the forward in backward, outside ``varlen_sdpa()``: both go to TRL."""
    from trl import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    from apprentice.lm.modeling import load_model, load_tokenizer
    from apprentice.training import packing
    from apprentice.training.packing import SharedPromptScoring, attention_of, use_varlen

    tok = load_tokenizer(tiny_model_dir, "compact")
    ids, mask, K = _block(tok, [5, 7], 0)
    model = load_model(tiny_model_dir, dtype="fp32")
    assert attention_of(model) == "sdpa"
    use_varlen(model)
    assert attention_of(model) == "sdpa_varlen"
    if setup == "eager":
        model.set_attn_implementation("eager")
    else:
        model.set_attn_implementation("sdpa")
        model.gradient_checkpointing_enable()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))

    class Scorer(SharedPromptScoring, GRPOTrainer):
        pass

    def refuse(*a, **k):
        raise AssertionError("flattened although the model would not attend the shared prefix")

    monkeypatch.setattr(packing, "shared_prompt_row", refuse)
    scorer = object.__new__(Scorer)
    scorer.accelerator = SimpleNamespace(autocast=contextlib.nullcontext, is_main_process=True)
    logps, _, _ = scorer._get_per_token_logps_and_entropies(model, ids, mask, K, compute_entropy=True)
    assert logps.shape == (2, K)
