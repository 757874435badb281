"""Loop rules: each rule builds the data it claims, SFT starts where the rule says, and
continuing SFT from a fitted checkpoint under the ``continue`` rule does not lose ground.

Real pieces throughout: the environment families, the rollout engine, the oracle teacher, the data
gate, TRL's SFTTrainer on the tiny Llama. The "champion" of the self/repair tests is a scripted
policy that follows the oracle plan for a few turns and then goes wrong (a real ``Policy``: what a
weak model does, without the cost of sampling one).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from apprentice.config import Config, ConfigError, load_config
from apprentice.data.trajectories import problems_frame, specs_of, trajectories_frame
from apprentice.envs import FAMILIES, env_for
from apprentice.paths import Paths
from apprentice.policies.base import Turn
from apprentice.policies.toolcalls import assistant_message, render_assistant
from apprentice.rollout.episodes import run_episodes
from apprentice.training import loop_rules as loop

REPO = Path(__file__).resolve().parents[2]


class SlipAfter:
    """Follows the oracle plan for ``good`` turns, then makes an invalid move every turn (fails)."""

    policy_id = "slip"
    needs_oracle_plan = True

    def __init__(self, good: int) -> None:
        self.good = good

    def act(self, conversations, tools, *, contexts=None):  # noqa: ANN001 (Policy protocol)
        out = []
        for conv, ctx in zip(conversations, contexts, strict=True):
            k = sum(1 for m in conv if m.get("role") == "assistant")
            plan = ctx["oracle_plan"]
            step = plan[k] if k < self.good and k < len(plan) else {"name": "move", "arguments": {"direction": "sideways"}}
            msg = assistant_message("", [step])
            out.append(Turn(message=msg, raw=render_assistant(msg)))
        return out


def _problems(n: int, level: int = 2, family: str = "grid", seed0: int = 100) -> pd.DataFrame:
    gen = FAMILIES[family].generate
    specs = [gen(seed0 + i, level) for i in range(n)]
    return problems_frame(specs, [level] * n, "train")


def _oracle_rows(n: int, seed0: int = 100, policy: str = "oracle") -> pd.DataFrame:
    from apprentice.policies.oracle import OraclePolicy

    df = trajectories_frame(run_episodes(_problems(n, seed0=seed0), OraclePolicy(), progress=False))
    df["policy_id"] = policy
    return df


# ---- config ------------------------------------------------------------------------------------

def test_loop_section_is_validated_at_load_naming_the_key(tmp_path):
    cfg = load_config(REPO / "params.yaml")
    assert cfg.loop.rule == "continue" and 0 < cfg.loop.lr_factor < 1
    for bad, key in (("loop.rule=restar", "loop.rule"), ("loop.lr_factor=0", "loop.lr_factor"),
                     ("loop.replay_share=1", "loop.replay_share"), ("loop.typo=1", "loop.typo")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(REPO / "params.yaml", overrides=[bad])


# ---- data rules ----------------------------------------------------------------------------------

def test_replay_share_is_honoured_and_draws_only_earlier_rows():
    new, old = _oracle_rows(10, 100), _oracle_rows(30, 500)
    for share in (0.0, 0.25, 0.5):
        out = loop.replay(loop._tagged(new, "teacher"), [loop._tagged(old, "iter 1 replay")], share, seed=0)
        replayed = out[out[loop.SOURCE] == "iter 1 replay"]
        assert len(replayed) == round(10 * share / (1 - share))
        assert abs(len(replayed) / len(out) - share) < 0.05
        assert set(replayed["problem_id"]) <= set(old["problem_id"])
        assert (out[loop.SOURCE] == "teacher").sum() == 10  # the new data always stays whole
    few = loop.replay(new, [old.head(3)], 0.9, seed=0)  # asks for 90 replay rows, 3 exist
    assert len(few) == 13
    a = loop.replay(new, [old], 0.5, seed=0)
    assert a.equals(loop.replay(new, [old], 0.5, seed=0))  # seeded


def test_union_holds_every_episode_once():
    a, b = _oracle_rows(8, 100), _oracle_rows(8, 104)  # 4 problems shared
    u = loop.union([a, b])
    assert len(u) == 12 and set(u["problem_id"]) == set(a["problem_id"]) | set(b["problem_id"])
    assert not u.duplicated(["problem_id", "policy_id", "sample_idx"]).any()


def _cfg(tmp_path: Path, **loop_over) -> tuple[Config, Paths]:
    over = [f"loop.{k}={v}" for k, v in loop_over.items()]
    return load_config(REPO / "params.yaml", overrides=over), Paths(tmp_path, 2)


def test_self_generated_rows_are_only_verifier_passed_and_gate_clean(tmp_path):
    from apprentice.stages.loop_data import _gate_kept

    cfg, _ = _cfg(tmp_path)
    probs = _problems(6)
    good = trajectories_frame(run_episodes(probs, SlipAfter(good=99), progress=False))
    bad = trajectories_frame(run_episodes(probs, SlipAfter(good=1), progress=False))
    assert good["success"].all() and not bad["success"].any()
    liar = bad.head(2).copy()
    liar["success"], liar["reward"] = True, 1.0  # a recorded success the calls do not earn
    kept, why = _gate_kept(cfg, pd.concat([good, liar], ignore_index=True))
    assert len(kept) == len(good) and kept["success"].all()
    assert set(kept["problem_id"]) == set(good["problem_id"]) and sum(why.values()) == 2
    mixed, n_own = loop.mix(loop._tagged(_oracle_rows(10), "teacher"), loop._tagged(kept, "self"), 0.5, seed=0)
    assert n_own == 5 and len(mixed) == 10 and (mixed[loop.SOURCE] == "self").sum() == 5


def test_first_error_is_the_first_turn_off_the_teachers_path():
    ep = trajectories_frame(run_episodes(_problems(1), SlipAfter(good=2), progress=False)).iloc[0]
    msgs = json.loads(ep["messages"])
    plan = [{"name": c.name, "arguments": dict(c.arguments)} for c in env_for(specs_of(_problems(1))[0]).oracle()]
    cut = loop.first_error(msgs, plan)
    assistants = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    assert cut == assistants[2]  # turns 0 and 1 follow the plan, turn 2 slips
    ok = trajectories_frame(run_episodes(_problems(1), SlipAfter(good=99), progress=False)).iloc[0]
    assert loop.first_error(json.loads(ok["messages"]), plan) is None


def test_repair_continues_from_the_cut_and_trains_on_the_continuation_only(tmp_path, tiny_model_dir):
    from apprentice.lm.modeling import load_model, load_tokenizer
    from apprentice.stages.loop_data import repaired
    from apprentice.training.sft import ApprenticeSFTTrainer, build_dataset, sft_trl_config

    cfg, paths = _cfg(tmp_path)
    failed = trajectories_frame(run_episodes(_problems(3), SlipAfter(good=2), progress=False))
    fixes = repaired(cfg, paths, failed)
    assert len(fixes) == 3 and fixes["success"].all()
    for (_, f), (_, c) in zip(fixes.iterrows(), failed.iterrows(), strict=True):
        fm, cm = json.loads(f["messages"]), json.loads(c["messages"])
        n = int(f[loop.CONTEXT])
        assert n == 2 + 2 * 2  # system, task, then two (call, observation) pairs on the plan
        assert fm[:n] == cm[:n]  # the prefix is the champion's, observations replayed identically
        assert fm[n]["role"] == "assistant" and fm[n] != cm[n]  # the teacher's correction at the error
    # the prefix's assistant turns carry no loss; every assistant turn of the continuation does
    tok = load_tokenizer(tiny_model_dir, "compact")
    row = fixes.iloc[0]
    msgs = json.loads(row["messages"])
    rec = {"messages": msgs, "tools": json.loads(row["tools"]), loop.CONTEXT: int(row[loop.CONTEXT])}
    plain = {"messages": msgs, "tools": rec["tools"]}

    def labelled(records):
        trainer = ApprenticeSFTTrainer(model=load_model(tiny_model_dir), processing_class=tok,
                                       args=sft_trl_config(cfg.sft.model_copy(update={"max_steps": 1}),
                                                           tmp_path / "w", "fp32"),
                                       train_dataset=build_dataset(records, tok, 0, 2048))
        ids, labels = trainer.train_dataset[0]["input_ids"], trainer.train_dataset[0]["labels"]
        return tok.decode([i for i, lab in zip(ids, labels, strict=True) if lab != -100])

    n_cont = sum(1 for m in msgs[rec[loop.CONTEXT]:] if m["role"] == "assistant")
    n_all = sum(1 for m in msgs if m["role"] == "assistant")
    assert labelled([rec]).count("<tool_call>") == n_cont < n_all == labelled([plain]).count("<tool_call>")
    assert "sideways" not in labelled([rec])


# ---- where SFT starts and at what learning rate ----------------------------------------------------

def test_sft_start_and_schedule_follow_the_rule(tmp_path):
    from apprentice.stages.sft import start_record

    champ = tmp_path / "models" / "iter_1" / "rl"
    champ.mkdir(parents=True)
    prev = Paths(tmp_path, 1)
    prev.promotion.parent.mkdir(parents=True)
    prev.promotion.write_text(json.dumps({"champion": {"kind": "rl", "version": 1, "iteration": 1, "root": ".",
                                                       "weights_path": "models/iter_1/rl", "md5": "x"}}))
    for rule, where in (("continue", "champion v1"), ("self", "champion v1"), ("repair", "champion v1"),
                        ("restart", "base (loop.rule=restart)")):
        cfg, paths = _cfg(tmp_path, rule=rule)
        assert start_record(cfg, paths)["source"] == where
    assert loop.sft_schedule("continue", 2, 2e-4, 0.1, 2) == pytest.approx((2e-5, 2))
    assert loop.sft_schedule("restart", 2, 2e-4, 0.1, 2) == (2e-4, 0)
    assert loop.sft_schedule("continue", 1, 2e-4, 0.1, 2) == (2e-4, 0)  # iteration 1 is the base recipe
    # a champion that is still the base model (no candidate beat it) fits nothing yet: the base recipe
    assert loop.sft_schedule("continue", 2, 2e-4, 0.1, 2, trained_start=False) == (2e-4, 0)
    # iteration k > 1 trains loop.max_steps on its larger set (new + replay); 0 keeps sft.max_steps
    assert [loop.sft_steps(k, 16, 48) for k in (1, 2, 3)] == [16, 48, 48]
    assert loop.sft_steps(2, 16, 0) == 16


def test_grpo_rate_scales_with_sfts_from_the_start_sft_recorded(tmp_path):
    """RL continues what SFT started: its rate scales by loop.lr_factor exactly when SFT's did, read from
    the start SFT recorded (a champion that is still the base model keeps the full rate)."""
    from apprentice.stages.rl import learning_rate

    assert loop.rl_learning_rate("continue", 2, 3e-5, 0.1) == pytest.approx(3e-6)
    assert loop.rl_learning_rate("continue", 1, 3e-5, 0.1) == 3e-5
    assert loop.rl_learning_rate("restart", 3, 3e-5, 0.1) == 3e-5
    assert loop.rl_learning_rate("continue", 2, 3e-5, 0.1, trained_start=False) == 3e-5
    cfg, paths = _cfg(tmp_path, rule="continue")
    assert paths.iteration == 2 and learning_rate(cfg, paths) == cfg.rl.learning_rate  # nothing recorded
    paths.sft_start.parent.mkdir(parents=True, exist_ok=True)
    for version, expected in ((1, cfg.rl.learning_rate * cfg.loop.lr_factor), (0, cfg.rl.learning_rate)):
        paths.sft_start.write_text(json.dumps({"start_model": {"version": version, "path": "x"}}))
        assert learning_rate(cfg, paths) == pytest.approx(expected)


def test_a_trained_checkpoint_keeps_the_base_tokenizer_template_and_generation_config(tmp_path, tiny_model_dir):
    """What SFT of iteration k > 1 loads from the champion is what iteration 1 loaded from the base:
    the same tokenizer, chat template, response parser and generation settings: only the weights differ."""
    from apprentice.lm.modeling import load_tokenizer
    from apprentice.training.sft import train_sft

    cfg, _ = _cfg(tmp_path)
    tok = load_tokenizer(tiny_model_dir, "compact")
    recs = [{"messages": json.loads(m), "tools": json.loads(t)} for m, t in
            zip(_oracle_rows(4)["messages"], _oracle_rows(4)["tools"], strict=True)]
    out = tmp_path / "sft"
    train_sft(tiny_model_dir, tok, recs, out, cfg.sft.model_copy(update={"max_steps": 1, "max_length": 768}))
    base = Path(tiny_model_dir)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / f).read_bytes() == (base / f).read_bytes(), f
    reloaded = load_tokenizer(out, "compact")
    assert reloaded.chat_template == tok.chat_template and reloaded.response_template == tok.response_template
    gen = json.loads((out / "generation_config.json").read_text())
    want = json.loads((base / "generation_config.json").read_text())
    assert {k: gen.get(k) for k in ("eos_token_id", "pad_token_id", "use_cache")} == \
           {k: want.get(k) for k in ("eos_token_id", "pad_token_id", "use_cache")}


# ---- why continuing at the base recipe loses ground, and what the continue rule bounds ---------------

def _mean_step(before: Path, after: Path) -> float:
    from safetensors.torch import load_file

    a, b = load_file(str(before / "model.safetensors")), load_file(str(after / "model.safetensors"))
    diffs = [(b[k] - a[k]).abs().flatten() for k in a if a[k].dim() == 2]  # the matrices (embeddings, projections)
    import torch

    return float(torch.cat(diffs).median())


def test_a_fresh_adamw_moves_every_weight_by_the_full_lr_whatever_the_gradient_and_continue_bounds_it(
        tmp_path, tiny_model_dir):
    """Why SFT continued from a fitted champion at the base recipe loses ground (docs/experiments.md):
    Adam's first update is ``lr * m / sqrt(v)`` = ``lr * sign(g)``, so continuing a fitted model (small,
    mostly-noise gradients) at the base recipe's learning rate moves the median weight by ~lr on the
    very first step, as far as the first step from the base model did. Scaling the loss (hence every
    gradient) by 1/20 changes nothing; the continue rule (lr x lr_factor with warm-up) cuts the movement
    by at least lr_factor."""
    from apprentice.lm.modeling import load_tokenizer
    from apprentice.training.sft import train_sft

    cfg, _ = _cfg(tmp_path)
    tok = load_tokenizer(tiny_model_dir, "compact")
    df = _oracle_rows(4)
    recs = [{"messages": json.loads(m), "tools": json.loads(t)} for m, t in zip(df["messages"], df["tools"], strict=True)]
    lr = 1e-3
    old = cfg.sft.model_copy(update={"max_steps": 1, "learning_rate": lr, "max_length": 768})
    train_sft(tiny_model_dir, tok, recs, tmp_path / "old", old)
    step_old = _mean_step(Path(tiny_model_dir), tmp_path / "old")
    assert 0.5 * lr < step_old <= 1.05 * lr  # a sign step: ~lr on the median weight

    from apprentice.training import sft as sft_mod

    class Scaled(sft_mod.ApprenticeSFTTrainer):  # the same data, gradients 20x smaller (a "fitted" model)
        def compute_loss(self, *a, **kw):  # noqa: ANN002, ANN003
            return super().compute_loss(*a, **kw) * 0.05

    orig = sft_mod.ApprenticeSFTTrainer
    sft_mod.ApprenticeSFTTrainer = Scaled
    try:
        train_sft(tiny_model_dir, tok, recs, tmp_path / "small", old)
    finally:
        sft_mod.ApprenticeSFTTrainer = orig
    assert _mean_step(Path(tiny_model_dir), tmp_path / "small") == pytest.approx(step_old, rel=0.2)

    lr_new, warm = loop.sft_schedule("continue", 2, lr, cfg.loop.lr_factor, cfg.loop.warmup_steps)
    new = old.model_copy(update={"max_steps": 2, "learning_rate": lr_new})
    train_sft(tiny_model_dir, tok, recs, tmp_path / "new", new, warmup_steps=warm)
    assert _mean_step(Path(tiny_model_dir), tmp_path / "new") <= cfg.loop.lr_factor * step_old * 1.05


def test_comparing_loop_rules_keeps_iteration_1_cached():
    """``dvc exp run -S loop.rule=...`` must rerun from loop-data-2 on: no stage of iteration 1 may
    declare a ``loop`` param (if sft-1 did, every rule would retrain and re-evaluate iteration 1)."""
    from apprentice.config import load_raw
    from apprentice.ops import dvcgen

    stages = dvcgen.pipeline(load_raw(Path(__file__).resolve().parents[2] / "params.yaml"))["stages"]
    first = {name: spec for name, spec in stages.items() if name.endswith("-1") or name == "evaluate-1"}
    assert "sft-1" in first and "loop-data-1" in first
    assert not [(n, p) for n, spec in first.items() for p in spec.get("params", []) if str(p).startswith("loop.")]
    assert "loop.rule" in stages["sft-2"]["params"] and "loop.rule" in stages["loop-data-2"]["params"]
