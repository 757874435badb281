"""Divergences, turn weighting, SOD, annealing and privileged prompts, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from apprentice.training.opd.annealing import ObjectiveMixer, group_advantages, policy_gradient_loss
from apprentice.training.opd.losses import beta_for, chunked_per_token_divergence, per_token_divergence
from apprentice.training.opd.privileged import privileged_messages
from apprentice.training.opd.weighting import base_weights, loss_weights, sod_multipliers

S = [0.7, 0.2, 0.1]  # student distribution over a 3-token vocabulary
T = [0.2, 0.5, 0.3]  # teacher


def kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q, strict=False))


def logits(p):
    return torch.log(torch.tensor([p], dtype=torch.float64))


@pytest.mark.parametrize(
    "divergence,expected",
    [
        ("forward_kl", kl(T, S)),
        ("reverse_kl", kl(S, T)),
        ("jsd", 0.5 * kl(T, [(s + t) / 2 for s, t in zip(S, T, strict=False)]) + 0.5 * kl(S, [(s + t) / 2 for s, t in zip(S, T, strict=False)])),
    ],
)
def test_divergence_matches_hand_computed(divergence, expected):
    d = per_token_divergence(logits(S), logits(T), beta_for(divergence, 0.5))
    assert d.shape == (1,)
    assert d.item() == pytest.approx(expected, rel=1e-6)


def test_generalised_jsd_beta_uses_trl_mixture_convention():
    beta = 0.9
    m = [(1 - beta) * s + beta * t for s, t in zip(S, T, strict=False)]
    expected = beta * kl(T, m) + (1 - beta) * kl(S, m)
    assert per_token_divergence(logits(S), logits(T), beta).item() == pytest.approx(expected, rel=1e-6)


def test_beta_for_rejects_degenerate_jsd():
    with pytest.raises(ValueError, match="forward_kl/reverse_kl"):
        beta_for("jsd", 0.0)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_chunked_kernel_agrees_with_logit_divergence_and_gradient(beta):
    torch.manual_seed(0)
    hs, ht = torch.randn(5, 4, requires_grad=True), torch.randn(5, 4)
    head_s, head_t = torch.nn.Linear(4, 7, bias=False), torch.nn.Linear(4, 7, bias=False)
    div, _ = chunked_per_token_divergence(hs, head_s, ht, head_t, beta)
    ref = per_token_divergence(head_s(hs), head_t(ht).detach(), beta)
    assert torch.allclose(div, ref, atol=1e-5)
    w = torch.tensor([0.1, 0.2, 0.3, 0.0, 0.4])  # weighted sum: gradient scales per token
    (g1,) = torch.autograd.grad((div * w).sum(), hs)
    (g2,) = torch.autograd.grad((per_token_divergence(head_s(hs), head_t(ht).detach(), beta) * w).sum(), hs)
    assert torch.allclose(g1, g2, atol=1e-5)
    assert g1[3].abs().sum() == 0  # zero weight -> no gradient


def test_turn_balanced_weights_give_each_turn_equal_mass():
    turns = torch.tensor([0, 0, 0, 0, 1, 2, 2])  # a 4-token turn, a 1-token turn, a 2-token turn
    tok = base_weights(turns, "token")
    assert torch.allclose(tok, torch.full((7,), 1 / 7))
    w = base_weights(turns, "turn")
    per_turn = [w[turns == k].sum().item() for k in range(3)]
    assert per_turn == pytest.approx([1 / 3] * 3)
    assert w.sum().item() == pytest.approx(1.0)


def test_sod_attenuates_high_divergence_turns():
    turns = torch.tensor([0, 0, 1, 1])
    div = torch.tensor([0.1, 0.1, 3.0, 3.0])  # turn 1 diverges 30x more
    m = sod_multipliers(div, turns, alpha=1.0)
    assert m[2] < m[0]
    ref = (0.1 + 3.0) / 2
    assert m[0].item() == pytest.approx(math.exp(-0.1 / ref)) and m[2].item() == pytest.approx(math.exp(-3.0 / ref))
    w = loss_weights(turns, div, "token", sod_alpha=1.0)
    assert w.sum().item() == pytest.approx(1.0) and w[2] < w[0]
    amplified = loss_weights(turns, div, "token", sod_alpha=-1.0)  # T-DUR direction
    assert amplified[2] > amplified[0]
    assert torch.allclose(loss_weights(turns, div, "token", 0.0), torch.full((4,), 0.25))


def test_annealing_opd_high_early_rl_rising_to_end_points():
    mix = ObjectiveMixer(total_steps=10, kind="cosine")
    assert mix.weights(0) == (1.0, 0.0)
    assert mix.weights(10) == (0.0, 1.0)
    early, late = mix.weights(2), mix.weights(8)
    assert early[0] > early[1] and late[1] > late[0]
    rl = [mix.weights(t)[1] for t in range(11)]
    assert all(a <= b for a, b in zip(rl, rl[1:], strict=False))


def test_group_advantages_and_pg_loss():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    g = torch.tensor([0, 0, 1, 1])
    a = group_advantages(r, g)
    assert a[0] > 0 > a[1]
    assert a[2] == 0 and a[3] == 0  # identical rewards -> no signal
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss = policy_gradient_loss(logp, torch.tensor([1.0, -1.0]))
    assert loss.item() == pytest.approx(-(-1.0 + 2.0) / 2)
    loss.backward()
    assert logp.grad.tolist() == [-0.5, 0.5]  # raise the good token's log-prob, lower the bad one's


def test_privileged_context_reaches_only_the_teacher_view():
    msgs = [{"role": "system", "content": "Act."}, {"role": "user", "content": "Find x."}]
    ctx = {"oracle_plan": [{"name": "look", "arguments": {"q": "x"}}, {"name": "answer", "arguments": {"a": 3}}]}
    teacher = privileged_messages(msgs, ctx, "oracle_plan")
    assert 'look({"q": "x"}); answer({"a": 3})' in teacher[0]["content"]
    assert msgs[0]["content"] == "Act."  # the student's messages are untouched
    assert teacher[1:] == msgs[1:]
    assert 'answer({"a": 3})' in privileged_messages(msgs, ctx, "answer")[0]["content"]
    assert privileged_messages(msgs, ctx, "none") == msgs
    with pytest.raises(ValueError, match="needs_oracle_plan"):
        privileged_messages(msgs, {}, "oracle_plan")


def test_mean_logprobs_scores_only_the_action_tokens(tiny_model_dir, smol_tokenizer_dir):
    from apprentice.lm.modeling import load_model, load_tokenizer
    from apprentice.training.opd.mixed import mean_logprobs

    tok, model = load_tokenizer(smol_tokenizer_dir), load_model(tiny_model_dir)
    prompts, actions = ["<|im_start|>user\nhi<|im_end|>\n", "a much longer prompt than the first one"], [" yes", " no way"]
    got = mean_logprobs(model, tok, prompts, actions)
    for p, a, g in zip(prompts, actions, got, strict=True):  # reference: one unpadded sequence at a time
        p_ids, a_ids = tok(p, add_special_tokens=False)["input_ids"], tok(a, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([p_ids + a_ids])
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        ref = lp[torch.arange(len(p_ids) - 1, ids.size(1) - 1), ids[0, len(p_ids):]].mean().item()
        assert g == pytest.approx(ref, abs=1e-4)
    assert mean_logprobs(model, tok, ["x"], [""]) == [None]


def test_encode_trajectory_masks_student_turns_and_aligns_the_privileged_teacher(smol_tokenizer_dir):
    from apprentice.data.trajectories import Trajectory
    from apprentice.lm.modeling import load_tokenizer
    from apprentice.policies.toolcalls import assistant_message
    from apprentice.training.opd.mixed import ACTOR_KEY, encode_trajectory

    tok = load_tokenizer(smol_tokenizer_dir)
    tools = [{"type": "function", "function": {"name": "press", "description": "Press a key.",
                                               "parameters": {"type": "object", "properties": {"key": {"type": "string"}}}}}]
    msgs = [{"role": "system", "content": "Press the keys."}, {"role": "user", "content": "Keys: a b"}]
    for who, key in (("student", "a"), ("teacher", "b"), ("student", "b")):
        msgs.append({**assistant_message("", [{"name": "press", "arguments": {"key": key}}]), ACTOR_KEY: who})
        msgs.append({"role": "tool", "name": "press", "content": f"pressed {key}"})
    traj = Trajectory("p", "keypad", "{}", "{}", 0, "mixed", 0, msgs, tools, 1.0, True, 3, False)
    ctx = {"oracle_plan": [{"name": "press", "arguments": {"key": "a"}}]}
    enc = encode_trajectory(traj, tok, privileged="oracle_plan", context=ctx)
    assert enc.actors == ["student", "teacher", "student"]
    assert sorted(set(enc.turn_index)) == [-1, 0, 1, 2]
    trained_turns = {k for k, m in zip(enc.turn_index, enc.loss_mask, strict=True) if m}
    assert trained_turns == {0, 2}  # the teacher's turn and the tool outputs are context only
    text = tok.decode([t for t, m in zip(enc.completion_ids, enc.loss_mask, strict=True) if m])
    assert text.count('"key": "a"') == 1 and text.count('"key": "b"') == 1 and "pressed" not in text
    assert enc.teacher_prompt_ids != enc.prompt_ids
    assert "Privileged hint" in tok.decode(enc.teacher_prompt_ids) and "Privileged" not in tok.decode(enc.prompt_ids)
    both = encode_trajectory(traj, tok, train_teacher_turns=True)
    assert {k for k, m in zip(both.turn_index, both.loss_mask, strict=True) if m} == {0, 1, 2}
