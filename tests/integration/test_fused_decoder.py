"""bf16 generation on the fused weight copies (apprentice.lm.fused) against the transformers model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from apprentice.lm import fused
from apprentice.lm.modeling import load_model, load_tokenizer
from apprentice.policies.hf_cached import CachedHFPolicy

pytestmark = pytest.mark.integration


@pytest.fixture()
def chatty(tiny_model_dir):
    """The tiny model with large random weights (varied greedy text), fresh per test: tests change it."""
    model, tok = load_model(tiny_model_dir, dtype="fp32", device="cpu"), load_tokenizer(tiny_model_dir, "model")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model, tok


def _prompts(tok, n=6):
    return [tok(f"Problem {i}: go {'left' if i % 2 else 'up'} {i + 1} times and report.", add_special_tokens=False)
            ["input_ids"] for i in range(n)]


def test_fused_forward_matches_the_transformers_model_under_autocast(chatty):
    """Same logits within bf16 rounding, prefill and one decode step, through the engine's cache layout."""
    model, tok = chatty
    ids = torch.tensor([_prompts(tok, 1)[0]])
    n = ids.shape[1]
    f = fused.FusedLlama(model)
    kv = [(torch.zeros(1, f.kv_heads, n + 1, f.head_dim, dtype=torch.bfloat16),
           torch.zeros(1, f.kv_heads, n + 1, f.head_dim, dtype=torch.bfloat16)) for _ in f.layers]
    mask = torch.ones(1, n + 1, dtype=torch.long)
    with torch.no_grad():
        ours = f.logits(f.decoder(ids, torch.arange(n)[None], mask, kv, 0))[0]
        nxt = ours[-1].argmax()[None, None]
        step = f.logits(f.decoder(nxt, torch.tensor([[n]]), mask, kv, n))[0, -1]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref = model(input_ids=torch.cat([ids, nxt], 1)).logits[0].float()
    scale = ref.abs().max()
    assert (ours - ref[:n]).abs().max() < 0.05 * scale
    assert (step - ref[n]).abs().max() < 0.05 * scale
    assert int(ours[-1].argmax()) == int(ref[n - 1].argmax())


def test_supports_only_what_it_computes(chatty, tiny_model_dir):
    model, _ = chatty
    assert fused.supports(model)
    model.config.attention_bias = True
    assert not fused.supports(model)
    model.config.attention_bias = False
    model.config.model_type = "qwen2"
    assert not fused.supports(model)


def test_bf16_engine_uses_the_copies_and_fp32_does_not(chatty):
    model, tok = chatty
    bf16 = CachedHFPolicy(model, tok, max_new_tokens=8, dtype="bf16")
    fp32 = CachedHFPolicy(model, tok, max_new_tokens=8, dtype="fp32")
    prompts = _prompts(tok)
    bf16.complete_ids(prompts), fp32.complete_ids(prompts)
    assert bf16._fused is not None and bf16._fused.copies == 1
    assert bf16._fused.head.dtype == torch.bfloat16 and bf16._buffers[0][0].dtype == torch.bfloat16
    assert fp32._fused is None and fp32._buffers[0][0].dtype == torch.float32


def test_weights_changed_in_place_are_copied_again_and_generate_as_a_fresh_engine(chatty):
    """An optimizer step changes the parameters in place: the next call must see the new weights,
    and must not reuse keys/values the old weights wrote."""
    model, tok = chatty
    pol = CachedHFPolicy(model, tok, max_new_tokens=10, dtype="bf16")
    prompts = _prompts(tok)
    before = pol.complete_ids(prompts)
    assert pol.complete_ids(prompts) == before and pol._fused.copies == 1  # unchanged weights: no copy
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    after = pol.complete_ids(prompts)
    assert pol._fused.copies == 2
    fresh = CachedHFPolicy(model, tok, max_new_tokens=10, dtype="bf16").complete_ids(prompts)
    assert after == fresh
    assert after != before


def test_replaced_parameters_are_copied_again(chatty):
    """A parameter whose tensor is replaced (a state dict loaded by assignment) counts as a change too."""
    model, tok = chatty
    pol = CachedHFPolicy(model, tok, max_new_tokens=6, dtype="bf16")
    pol.complete_ids(_prompts(tok, 2))
    w = model.model.layers[0].mlp.down_proj.weight
    model.model.layers[0].mlp.down_proj.weight = torch.nn.Parameter(w.detach().clone() * 2)
    assert pol.sync_weights() and pol._fused.copies == 2
    assert not pol.sync_weights()
    assert torch.equal(pol._fused.layers[0]["down"], (w.detach() * 2).to(torch.bfloat16))


def test_shared_prefix_and_reuse_give_what_a_cold_call_gives(chatty):
    """The fused path writes keys/values the store reuses: a second turn reusing the first's cache
    decodes what a cold engine decodes for the whole conversation."""
    model, tok = chatty
    prompts = _prompts(tok)
    warm = CachedHFPolicy(model, tok, max_new_tokens=8, dtype="bf16")
    first = warm.complete_ids(prompts)
    second = [p + f + tok(" and then?", add_special_tokens=False)["input_ids"] for p, f in zip(prompts, first, strict=True)]
    reused = warm.complete_ids(second)
    assert warm.stats["reused_tokens"] > 0
    cold = CachedHFPolicy(model, tok, max_new_tokens=8, dtype="bf16").complete_ids(second)
    agree = np.mean([a == b for a, b in zip(reused, cold, strict=True)])
    assert agree >= 5 / 6  # bf16: a reused prefix sums in another order than a cold prefill
