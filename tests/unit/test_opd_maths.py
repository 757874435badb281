"""The OPD/ATOD training maths agree with TRL, the loss moves the right way, and a rollout
inside training leaves the global RNGs alone."""

from __future__ import annotations

import pytest
import torch
from trl.trainer.distillation_trainer import _chunked_divergence_loss
from trl.trainer.utils import nanstd

from apprentice.training.opd.annealing import (
    ObjectiveMixer,
    group_advantages,
    policy_gradient_loss,
    token_share,
)
from apprentice.training.opd.losses import beta_for, chunked_per_token_divergence
from apprentice.training.opd.weighting import loss_weights


def _trl_group_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """GRPOTrainer._generate_and_score_completions, scale_rewards="group", one reward function."""
    mean = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
    std = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
    return (rewards - mean) / (std + 1e-4)


@pytest.mark.parametrize("rewards,G", [([1.0, 0.0], 2), ([1.0, 0.0, 0.0, 1.0, 0.3, 0.9, 0.1, 0.5], 4),
                                       ([0.2, 0.2, 0.2, 1.0, 0.0, 0.0], 3)])
def test_group_advantages_equal_trls(rewards, G):
    r = torch.tensor(rewards)
    groups = torch.arange(len(rewards)) // G
    ours = group_advantages(r, groups)
    assert torch.allclose(ours, _trl_group_advantages(r, G), atol=1e-6)
    if rewards == [1.0, 0.0]:
        assert ours.tolist() == pytest.approx([0.7071, -0.7071], abs=1e-3)


def _batch(n_tokens: int, seed: int, hidden: int = 8, vocab: int = 11):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_tokens, hidden, generator=g), torch.randn(n_tokens, hidden, generator=g)


def test_opd_loss_is_trls_under_gradient_accumulation():
    """Two micro-batches of 3 and 9 loss tokens in one accumulation window: our per-micro-batch losses
    sum to TRL's token mean over the window (and to TRL's own per-micro-batch losses), not to the mean of
    the two micro-batch means that ignoring ``num_items_in_batch`` gave."""
    torch.manual_seed(0)
    s_head, t_head = torch.nn.Linear(8, 11, bias=False), torch.nn.Linear(8, 11, bias=False)
    beta = 0.5
    micro = [_batch(3, 1), _batch(9, 2)]
    n_total = torch.tensor(12)
    ours, trls = [], []
    for hs, ht in micro:
        div, _ = chunked_per_token_divergence(hs, s_head, ht, t_head, beta)
        w = loss_weights(torch.arange(len(hs)), div.detach(), "token")
        ours.append((div * w).sum() * token_share(div.numel(), n_total))
        mask = torch.ones(1, len(hs), dtype=torch.long)
        trls.append(_chunked_divergence_loss(hs[None], ht[None], s_head.weight, t_head.weight, mask, beta,
                                             num_items_in_batch=n_total)[0])
    hs_all = torch.cat([m[0] for m in micro])[None]
    ht_all = torch.cat([m[1] for m in micro])[None]
    whole = _chunked_divergence_loss(hs_all, ht_all, s_head.weight, t_head.weight,
                                     torch.ones(1, 12, dtype=torch.long), beta)[0]
    ours = [o.detach() for o in ours]
    assert float(sum(ours)) == pytest.approx(float(whole.detach()), rel=1e-5)
    assert float(sum(ours)) == pytest.approx(float(sum(t.detach() for t in trls)), rel=1e-5)
    mean_of_means = sum(float(chunked_per_token_divergence(h, s_head, t, t_head, beta)[0].detach().mean())
                        for h, t in micro)
    assert float(sum(ours)) != pytest.approx(mean_of_means, rel=1e-3)
    assert token_share(5, None) == 1.0  # evaluation: the micro-batch mean


@pytest.mark.parametrize("objective", ["forward_kl", "reverse_kl", "jsd", "jsd_turn_sod", "grpo", "atod"])
def test_each_objective_falls_on_a_fixed_batch(objective):
    """A few SGD steps on the student head lower the objective the trainer optimises (same building
    blocks as OPDTrainer._compute_loss): the sign and the normalisation point the right way."""
    torch.manual_seed(0)
    hs, ht = _batch(12, 3)
    s_head, t_head = torch.nn.Linear(8, 11), torch.nn.Linear(8, 11)
    t_head.requires_grad_(False)
    turn_ids = torch.tensor([0] * 4 + [1] * 2 + [10_000] * 6)  # 2 episodes, 3 turns
    tokens = torch.randint(0, 11, (12,), generator=torch.Generator().manual_seed(4))
    adv = group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))
    token_adv = torch.cat([adv[0].expand(6), adv[1].expand(6)])
    divergence = {"jsd_turn_sod": "jsd", "atod": "jsd"}.get(objective, objective)
    mixer = {"grpo": ObjectiveMixer(1, 0.0, 0.0, 1.0, 1.0, "constant"),
             "atod": ObjectiveMixer(1, 0.5, 0.5, 0.5, 0.5, "constant")}.get(objective, ObjectiveMixer(1, 1, 1, 0, 0))
    opt = torch.optim.SGD(s_head.parameters(), lr=0.5)

    def loss_fn() -> torch.Tensor:
        w_opd, w_rl = mixer.weights(0)
        beta = beta_for(divergence if divergence != "grpo" else "jsd", 0.5)
        div, _ = chunked_per_token_divergence(hs, s_head, ht, t_head, beta)
        mode, alpha = ("turn", 0.5) if objective == "jsd_turn_sod" else ("token", 0.0)
        w = loss_weights(turn_ids, div.detach(), mode, alpha)
        share = token_share(div.numel(), torch.tensor(24))  # a two-micro-batch window
        loss = w_opd * (div * w).sum() * share
        if w_rl > 0:
            logps = torch.log_softmax(s_head(hs), -1).gather(-1, tokens[:, None]).squeeze(-1)
            loss = loss + w_rl * policy_gradient_loss(logps, token_adv) * share
        return loss

    first = float(loss_fn())
    for _ in range(10):
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
    assert float(loss_fn()) < first - 1e-4, objective


def test_rollouts_leave_the_global_rngs_alone():
    """run_episodes (called every OPD training step) seeds its own sampling but restores the global
    torch and Python RNG states, so dropout and data order in training are not reseeded."""
    import random

    from apprentice.envs import FAMILIES
    from apprentice.policies.oracle import OraclePolicy
    from apprentice.rollout.episodes import run_episodes

    specs = [FAMILIES["grid"].generate(1, 0)]
    torch.manual_seed(123)
    random.seed(5)
    expected = (torch.rand(3), random.random())
    torch.manual_seed(123)
    random.seed(5)
    run_episodes(specs, OraclePolicy(), seed=7, progress=False)
    after = (torch.rand(3), random.random())
    assert torch.equal(after[0], expected[0]) and after[1] == expected[1]
