"""Which earlier evaluation drafts a model's greedy turns (``stages.evaluate.draft_source``)."""

from __future__ import annotations

from pathlib import Path

from apprentice.config import load_config
from apprentice.paths import Paths
from apprentice.stages.evaluate import draft_source

ROOT = Path(__file__).resolve().parents[2]


def _touch(p: Path) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"")
    return p


def test_each_model_drafts_from_the_model_it_was_trained_from_where_that_one_was_scored(tmp_path):
    cfg = load_config(ROOT / "params.yaml", overrides=["promote.candidate=rl"])
    one, two = Paths(tmp_path, 1), Paths(tmp_path, 2)
    assert all(draft_source(cfg, p, m) is None for p in (one, two) for m in ("base", "sft", "rl", "student"))
    sft1 = _touch(one.eval_episodes("sft"))
    assert draft_source(cfg, one, "rl") == sft1  # RL continues from SFT
    assert draft_source(cfg, one, "student") == sft1  # the RL teacher not scored yet: its own parent
    rl1 = _touch(one.eval_episodes("rl"))
    assert draft_source(cfg, one, "student") == rl1  # distilled from the RL teacher
    assert draft_source(cfg, one, "sft") is None  # iteration 1's SFT starts from the base model
    assert draft_source(cfg, two, "sft") == rl1  # iteration 2's continues from the candidate
    assert draft_source(cfg, one, "base") is None and draft_source(cfg, one, "/some/model") is None


def test_sft_of_iteration_k_drafts_from_the_champion_the_promotion_record_names(tmp_path):
    """With SFT promoted in iteration 2 (an alternate that beat the champion), SFT-3 continues from SFT-2."""
    import json

    cfg = load_config(ROOT / "params.yaml", overrides=["promote.candidate=rl"])
    two, three = Paths(tmp_path, 2), Paths(tmp_path, 3)
    sft2, _ = _touch(two.eval_episodes("sft")), _touch(two.eval_episodes("rl"))
    two.promotion.parent.mkdir(parents=True, exist_ok=True)
    two.promotion.write_text(json.dumps({"champion": {"kind": "sft", "iteration": 2, "version": 2}}))
    assert draft_source(cfg, three, "sft") == sft2
    two.promotion.write_text(json.dumps({"champion": {"kind": "base", "iteration": 0, "version": 0}}))
    base = _touch(two.eval_episodes("base"))
    assert draft_source(cfg, three, "sft") == base
