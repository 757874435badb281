"""Padding-free SFT (per-sequence attention, LM head on loss positions only) is the same objective as
TRL's padded default: equal loss and equal gradients on the same batch, on a real (tiny) model."""

from __future__ import annotations

import inspect

import pytest
import torch


def _batch(tok, seeds=(0, 1, 2)):
    """Oracle episodes of one family (grid, level 0) as (token ids, labels on the assistant tokens)."""
    from apprentice.envs import FAMILIES
    from apprentice.policies.oracle import OraclePolicy
    from apprentice.rollout.episodes import run_episodes

    specs = [FAMILIES["grid"].generate(seed, 0) for seed in seeds]
    trajs = run_episodes(specs, OraclePolicy(), progress=False)
    out = []
    for t in trajs:
        enc = tok.apply_chat_template(t.messages, tools=t.tools, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        ids = torch.tensor(enc["input_ids"])
        labels = torch.where(torch.tensor(enc["assistant_masks"], dtype=torch.bool), ids, torch.tensor(-100))
        out.append((ids, labels))
    return out


def _padded(items, pad_id):
    T = max(len(i) for i, _ in items)
    ids = torch.full((len(items), T), pad_id)
    labels = torch.full((len(items), T), -100)
    mask = torch.zeros((len(items), T), dtype=torch.long)
    for r, (i, lab) in enumerate(items):
        ids[r, : len(i)], labels[r, : len(i)], mask[r, : len(i)] = i, lab, 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _flat(items):
    lens = [len(i) for i, _ in items]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return {"input_ids": torch.cat([i for i, _ in items])[None], "labels": torch.cat([lab for _, lab in items])[None],
            "position_ids": torch.cat([torch.arange(n) for n in lens])[None], "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
            "max_length_q": max(lens), "max_length_k": max(lens)}


def test_padding_free_compact_loss_and_grads_equal_the_padded_full_head(tiny_model_dir):
    from apprentice.lm.modeling import load_model, load_tokenizer
    from apprentice.training.packing import compact_nll, use_varlen

    tok = load_tokenizer(tiny_model_dir, "compact")
    items = _batch(tok)
    ref = load_model(tiny_model_dir, dtype="fp32")
    padded = _padded(items, tok.pad_token_id)
    logits = ref(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits[:, :-1]
    target = padded["labels"][:, 1:]
    loss_ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1),
                                                 ignore_index=-100, reduction="sum")
    loss_ref.backward()

    fast = load_model(tiny_model_dir, dtype="fp32")
    restore = use_varlen(fast)
    assert fast.config._attn_implementation == "sdpa_varlen" and restore == "sdpa"
    nll, stats = compact_nll(fast, _flat(items))
    nll.backward()
    assert int(stats["n"]) == int((target != -100).sum())
    torch.testing.assert_close(nll, loss_ref, rtol=1e-5, atol=1e-4)
    for (name, p), q in zip(ref.named_parameters(), fast.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
    # no cu_seq_lens (generation, evaluation): plain sdpa, same logits as the reference model
    x = padded["input_ids"][:1, : len(items[0][0])]
    torch.testing.assert_close(fast(input_ids=x).logits, ref(input_ids=x).logits, rtol=1e-5, atol=1e-5)


def test_a_shared_prefix_encoded_once_gives_the_same_loss_and_gradients(tiny_model_dir):
    """Three conversations of one family: the flattened row without the repeated system prompt and tool
    schemas is shorter by twice their common prefix, and its loss and gradients are the same."""
    from apprentice.lm.modeling import load_model, load_tokenizer
    from apprentice.training.packing import compact_nll, share_prefix, use_varlen

    tok = load_tokenizer(tiny_model_dir, "compact")
    items = _batch(tok)
    flat = _flat(items)
    shared, prefix = share_prefix(flat)
    first_supervised = min(int((lab != -100).nonzero()[0]) for _, lab in items)
    assert 16 <= prefix < first_supervised
    assert shared["input_ids"].shape[1] == flat["input_ids"].shape[1] - 2 * prefix
    assert shared["cu_seq_lens_q"].tolist()[:2] == [0, prefix]
    assert int((shared["labels"] != -100).sum()) == int((flat["labels"] != -100).sum())

    grads = []
    for batch in (flat, shared):
        model = load_model(tiny_model_dir, dtype="fp32")
        use_varlen(model)
        nll, stats = compact_nll(model, batch)
        nll.backward()
        grads.append((nll.detach(), int(stats["n"]), [p.grad for p in model.parameters()]))
    (ref, n_ref, g_ref), (got, n_got, g_got) = grads
    assert n_got == n_ref
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    for a, b in zip(g_got, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_share_prefix_stops_before_a_supervised_token_and_leaves_unrelated_batches_alone(tiny_model_dir):
    from apprentice.lm.modeling import load_tokenizer
    from apprentice.training.packing import share_prefix

    tok = load_tokenizer(tiny_model_dir, "compact")
    (a, la), (b, lb) = _batch(tok, seeds=(0, 1))
    assert share_prefix(_flat([(a, la)]))[1] == 0  # one conversation
    # the same conversation twice: every token is common, but the second copy's targets must keep their loss
    _, prefix = share_prefix(_flat([(a, la), (a, la)]))
    assert prefix == int((la != -100).nonzero()[0]) - 1
    # no common prefix worth sharing
    other = torch.flip(b, [0])
    assert share_prefix(_flat([(a, la), (other, torch.full_like(other, -100))]))[1] == 0


def test_prefix_grouped_sampler_batches_a_group_together_in_a_seeded_random_order():
    from apprentice.training.packing import PrefixGroupedSampler

    groups = ["g"] * 7 + ["s"] * 6 + ["t"]
    sampler = PrefixGroupedSampler(groups, batch_size=2, seed=3)
    order = list(sampler)
    assert sorted(order) == list(range(14)) and len(sampler) == 14
    batches = [order[i:i + 2] for i in range(0, 14, 2)]
    assert sum(len({groups[i] for i in b}) == 1 for b in batches) == 6  # all but the leftovers (one g, one t)
    assert order == list(PrefixGroupedSampler(groups, 2, 3))  # seeded: a resumed run skips into the same order
    assert order != list(PrefixGroupedSampler(groups, 2, 4))
    sampler.set_epoch(1)
    assert list(sampler) != order
    odd_groups = ["g"] * 4 + ["s"] * 3
    odd = list(PrefixGroupedSampler(odd_groups, batch_size=2, seed=0))
    assert len(odd) == 7 and odd_groups[odd[-1]] == "s"  # the short batch is last: the others stay aligned
    assert all(odd_groups[odd[i]] == odd_groups[odd[i + 1]] for i in range(0, 6, 2))


def test_trl_sft_trainer_contract():
    """What ApprenticeSFTTrainer relies on in the pinned TRL: compute_loss's signature, the metrics dict
    it appends to, and padding-free collation carrying sequence boundaries."""
    from trl import SFTTrainer
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    assert list(inspect.signature(SFTTrainer.compute_loss).parameters) == [
        "self", "model", "inputs", "return_outputs", "num_items_in_batch"]
    assert "self._metrics[mode]" in inspect.getsource(SFTTrainer.compute_loss)
    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(
        [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    assert batch["input_ids"].shape == (1, 5) and batch["cu_seq_lens_q"].tolist() == [0, 3, 5]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]] and "attention_mask" not in batch


@pytest.mark.parametrize(("n_keep", "expected"), [(4, [0, 2, 4, 5]), (6, [0, 1, 2, 3, 4, 5])])
def test_student_layer_rules(n_keep, expected):
    from apprentice.training.student import block_layers, influence_layers

    influence = [0.9, 0.1, 0.5, 0.05, 0.4, 0.8]
    assert influence_layers(influence, n_keep) == expected  # first and last always kept
    # the most similar (input, output) pair: dropping layers 2-3 changes the residual stream least
    assert block_layers([0.0, 0.5, 0.9, 0.7, 0.1], 6, 4) == [0, 1, 4, 5]


def test_block_influence_is_one_minus_each_layers_input_output_cosine(tiny_model_dir):
    from apprentice.lm.modeling import load_model
    from apprentice.training.student import block_influence, block_similarity

    model = load_model(tiny_model_dir, dtype="fp32")
    ids = [torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))]
    hs = model(input_ids=ids[0], output_hidden_states=True).hidden_states
    direct = [float(1 - torch.nn.functional.cosine_similarity(hs[i], hs[i + 1], dim=-1).mean()) for i in range(len(hs) - 1)]
    assert block_influence(model, ids) == pytest.approx(direct, abs=1e-5)
    assert len(block_similarity(model, ids, 2)) == len(hs) - 2


def test_the_sft_trainer_draws_micro_batches_of_one_family(tiny_model_dir, tmp_path):
    from apprentice.config import SFTConfig
    from apprentice.envs import FAMILIES
    from apprentice.lm.modeling import load_model, load_tokenizer
    from apprentice.policies.oracle import OraclePolicy
    from apprentice.rollout.episodes import run_episodes
    from apprentice.training.packing import PrefixGroupedSampler, share_prefix
    from apprentice.training.sft import PREFIX_GROUP, ApprenticeSFTTrainer, build_dataset, sft_trl_config

    tok = load_tokenizer(tiny_model_dir, "compact")
    specs = [FAMILIES[f].generate(seed, 0) for f in ("grid", "search") for seed in range(4)]
    records = [{"messages": t.messages, "tools": t.tools} for t in run_episodes(specs, OraclePolicy(), progress=False)]
    dataset = build_dataset(records, tok, 0, 768)
    assert len(set(dataset[PREFIX_GROUP])) == 2
    args = sft_trl_config(SFTConfig(max_steps=1, batch_size=2), tmp_path, "fp32")
    trainer = ApprenticeSFTTrainer(model=load_model(tiny_model_dir, dtype="fp32"), args=args, train_dataset=dataset,
                                   processing_class=tok)
    assert isinstance(trainer._get_train_sampler(), PrefixGroupedSampler)
    rendered = [tok.apply_chat_template(r["messages"], tools=r["tools"], tokenize=True, return_dict=True)["input_ids"]
                for r in records]
    across = next(i for i, (a, b) in enumerate(zip(rendered[0], rendered[-1], strict=False)) if a != b)
    batches = list(trainer.get_train_dataloader())
    assert len(batches) == 4
    for batch in batches:  # each shares its family's system prompt and tool schemas, longer than any cross-family prefix
        assert share_prefix(batch)[1] > across
