"""The training stages on a tiny random model: real TRL trainers, real environments, real checkpoints.

A two-word environment (``echo``) keeps prompts short so each TRL step stays cheap; it is registered
only for the duration of each test (``monkeypatch``), the real families are untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerCallback

from apprentice.paths import Paths
from apprentice.training.common import METRICS_FILE, read_metrics, work_dir_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from echokit import EchoEnv, config, write_data  # noqa: E402

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _changed(model_dir: str | Path, reference: str | Path) -> int:
    a = AutoModelForCausalLM.from_pretrained(str(model_dir)).state_dict()
    b = AutoModelForCausalLM.from_pretrained(str(reference)).state_dict()
    return sum(not torch.equal(a[k], b[k]) for k in b)


class _CrashAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            raise RuntimeError(f"simulated crash at step {self.step}")


def test_sft_logs_trains_resumes_from_checkpoint_and_skips_when_done(tmp_path, tiny_model_dir, echo_env):
    from apprentice.stages import sft

    paths = Paths(tmp_path)
    write_data(paths)
    cfg = config(tiny_model_dir, sft={"max_steps": 3, "batch_size": 2, "grad_accum": 1, "learning_rate": 1e-4,
                                      "max_length": 128, "save_steps": 1})

    with pytest.raises(RuntimeError, match="simulated crash"):  # checkpoint-1 is written, step 2 dies
        sft.run(cfg, paths, callbacks=[_CrashAt(2)])
    work = work_dir_for(paths.sft_model)
    assert (work / "checkpoint-1").is_dir() and not paths.sft_model.exists()

    result = sft.run(cfg, paths)
    assert result["resumed_from_step"] == 1 and result["steps"] == 3
    rows = [r for r in read_metrics(paths.sft_model / METRICS_FILE) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]  # continued from the checkpoint, not from zero
    assert all(r["loss"] > 0 and "learning_rate" in r for r in rows)
    tokens = [r["num_tokens"] for r in rows]
    assert tokens == sorted(set(tokens)), tokens  # TRL's counter continues across the resume, not from 0
    assert result["train_loss"] == sum(r["loss"] for r in rows) / 3  # over all steps, not those after resume
    # golden losses of the seeded tiny model (torch 2.x CPU, fp32): a change to the data collation,
    # the loss masking or its normalisation moves them; a resume must not (it replays the same batches)
    assert [r["loss"] for r in rows] == pytest.approx([10.83373, 10.79577, 10.76389], rel=1e-4)
    assert "time" not in rows[0]  # wall clock stays out of the DVC output (models/iter_k/.timings/)
    # DVCLive's files in the model folder (what dvc.yaml's plots/metrics declare) hold the same curve,
    # continued across the resume (steps 1, 2, 3 once each), and no wall-clock metric
    from apprentice.training import curves

    live = paths.sft_model / curves.DVCLIVE_DIR
    logged = [r for r in curves.read_dvclive(live) if "loss" in r]
    assert [r["step"] for r in logged] == [1, 2, 3]
    assert [r["loss"] for r in logged] == [r["loss"] for r in rows]
    assert [r["num_tokens"] for r in logged] == tokens
    assert (live / "plots/metrics/loss.tsv").read_text().splitlines()[0] == "step\tloss"
    summary = curves.summary(live)
    assert summary["step"] == 3 and summary["loss"] == rows[-1]["loss"]
    assert summary["train"]["loss"] == result["train_loss"]  # HF's train_loss, DVCLive's train/loss
    assert "train_runtime" not in summary and not (live / "plots/metrics/train_runtime.tsv").exists()
    assert _changed(paths.sft_model, tiny_model_dir) > 0
    cfg_json = json.loads((paths.sft_model / "config.json").read_text())
    # SFTTrainer leaves use_cache False; restored before saving, or the saved model generates uncached
    assert cfg_json["use_cache"] is True
    assert not work.exists()  # checkpoints dropped after success

    assert sft.run(cfg, paths)["skipped"] is True  # same params + inputs: no-op


def test_sft_deepspeed_zero2_runs_on_cpu_through_the_cli(tmp_path, tiny_model_dir, echo_env):
    paths = Paths(tmp_path)
    write_data(paths, n=2)
    params = tmp_path / "params.yaml"
    params.write_text(json.dumps({"model": {"base": tiny_model_dir, "dtype": "fp32"},
                                  "sft": {"max_steps": 1, "batch_size": 2, "grad_accum": 1, "max_length": 128,
                                          "deepspeed": "zero2"}}))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    # the echo family must exist in the child too: register it through a tiny wrapper module
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_training as t; from apprentice.envs import FAMILIES; "
            "FAMILIES['echo'] = t.EchoEnv; from apprentice.__main__ import main; "
            f"sys.exit(main(['sft', '--params', {str(params)!r}, '--root', {str(tmp_path)!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout[proc.stdout.index("{\n"):])  # the CLI prints the stage summary last
    assert result["deepspeed_zero_stage"] == 2 and result["steps"] == 1
    rows = [r for r in read_metrics(paths.sft_model / METRICS_FILE) if "loss" in r]
    assert rows and rows[0]["step"] == 1
    AutoModelForCausalLM.from_pretrained(str(paths.sft_model))  # plain HF folder


def _length_reward(completions, **kw):
    """Reward variance for a random model that never calls tools (GRPO needs within-group variance)."""
    return [float(len(str(c)) % 5) for c in completions]


def test_rl_grpo_with_environment_factory_curriculum_and_probe(tmp_path, tiny_model_dir, echo_env):
    from apprentice.stages import rl

    paths = Paths(tmp_path)
    write_data(paths)
    shutil.copytree(tiny_model_dir, paths.sft_model)
    cfg = config(tiny_model_dir, rl={"max_steps": 1, "prompts_per_step": 2, "num_generations": 2,
                                      "max_completion_length": 24, "probe_samples": 2, "probe_problems": 2})
    result = rl.run(cfg, paths, reward_funcs=[_length_reward])
    assert result["steps"] == 1 and result["sampler"] == "engine"
    # a random model never solves: both probed problems are dropped, the two unprobed ones stay
    assert {k: result["curriculum"][k] for k in ("probed", "never_solved", "kept")} == {
        "probed": 2, "never_solved": 2, "kept": 2}
    rows = read_metrics(paths.rl_model / METRICS_FILE)
    step = next(r for r in rows if "loss" in r)
    assert "rewards/EchoEnv/mean" in step and "reward" in step  # the environment's get_reward is wired in
    from apprentice.training import curves

    live = curves.read_dvclive(paths.rl_model / curves.DVCLIVE_DIR)  # GRPO's curves reach DVC's plots too
    assert any("rewards/EchoEnv/mean" in r and "loss" in r for r in live), live
    order = json.loads((paths.rl_model / "curriculum.json").read_text())["order"]
    from apprentice.curriculum import order_by_difficulty
    from apprentice.data.trajectories import read_parquet

    ordered = order_by_difficulty(read_parquet(paths.problems))["problem_id"].tolist()
    # the probe spreads over the order (first and last of 4): the two unprobed problems stay
    assert sorted(order) == sorted(ordered[1:3])
    assert _changed(paths.rl_model, tiny_model_dir) > 0


def test_distill_builds_pruned_student_warm_starts_and_distills(tmp_path, smol_tokenizer_dir, echo_env):
    from apprentice.lm.modeling import load_model, load_tokenizer, make_tiny_model
    from apprentice.stages import distill
    from apprentice.training.student import build_student

    paths = Paths(tmp_path)
    write_data(paths, n=2)
    make_tiny_model(load_tokenizer(smol_tokenizer_dir), paths.sft_model, hidden=64, layers=4, seed=1)
    cfg = config(str(paths.sft_model), sft={"batch_size": 2, "grad_accum": 1, "max_length": 128},
                  distill={"max_steps": 1, "batch_size": 2, "max_completion_length": 8, "divergence": "reverse_kl",
                           "student": {"keep_every": 3, "prune": "every", "warmup_steps": 1, "warmup_lr": 1e-3}})
    result = distill.run(cfg, paths)
    assert result["teacher"] == str(paths.sft_model)  # no RL model in this iteration: SFT model teaches
    assert result["beta"] == 1.0 and result["steps"] == 1 and result["sampler"] == "engine"  # the student samples through the engine
    info = json.loads((paths.student_model / "student.json").read_text())
    assert info["student_params"] < info["teacher_params"]
    student = AutoModelForCausalLM.from_pretrained(str(paths.student_model))
    assert student.config.num_hidden_layers == 2  # layers 0 and 3 of 4
    rows = read_metrics(paths.student_model / METRICS_FILE)
    assert {r["stage"] for r in rows if "loss" in r} == {"student_warmup", "distill"}
    from apprentice.training import curves

    assert [r["step"] for r in curves.read_dvclive(paths.student_model / curves.DVCLIVE_DIR)] == [1]  # distillation's
    pruned = build_student(load_model(paths.sft_model), "prune", 3)
    init = pruned.state_dict()
    trained = student.state_dict()
    assert sum(not torch.equal(trained[k], init[k]) for k in init) > 0


def test_sft_horizon_cuts_at_turn_boundaries_and_lora_saves_a_merged_plain_model(tmp_path, tiny_model_dir):
    from apprentice.config import SFTConfig
    from apprentice.lm.modeling import load_tokenizer
    from apprentice.training.sft import apply_horizon, train_sft

    tok = load_tokenizer(tiny_model_dir)
    tools = EchoEnv.tool_schemas()
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "say", "arguments": {"word": "red"}}}]}
    messages = [{"role": "system", "content": "Say the word."}, {"role": "user", "content": "Word: red"},
                call, {"role": "tool", "name": "say", "content": "Wrong."},
                call, {"role": "tool", "name": "say", "content": "Wrong."},
                call, {"role": "tool", "name": "say", "content": "Correct."}]
    record = {"messages": messages, "tools": tools}
    assert apply_horizon(record, tok, 0) is record  # 0 = no horizon
    assert len(apply_horizon(record, tok, 10_000)["messages"]) == 7  # whole episode, ends on the last call
    assert len(apply_horizon(record, tok, 1)["messages"]) == 3  # at least the first assistant turn
    two_turns = apply_horizon(record, tok, 60)["messages"]
    assert two_turns[-1]["role"] == "assistant" and 3 <= len(two_turns) < 7

    sft = SFTConfig(max_steps=1, batch_size=2, max_length=128, lora=True, lora_r=4, horizon_tokens=60)
    result = train_sft(tiny_model_dir, tok, [record, record], tmp_path / "lora", sft, dtype="fp32")
    assert result["steps"] == 1
    assert not (tmp_path / "lora" / "adapter_config.json").exists()  # merged: a plain HF folder
    assert _changed(tmp_path / "lora", tiny_model_dir) > 0


def test_grpo_samples_through_the_engine_the_tokens_trl_generate_gives(tmp_path, tiny_model_dir):
    """GRPO's sampler is the pipeline's engine (``CurriculumGRPOTrainer._generate_single_turn``): made
    greedy, it returns TRL's plain ``generate`` path's completion ids (fp32), for the first turn and
    for a tool round that extends it, where it reuses the first round's keys/values."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from apprentice.lm.modeling import load_model, load_tokenizer
    from apprentice.training.rl import CurriculumGRPOTrainer

    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # large random weights: varied greedy text, not one repeated token
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=12, generation_kwargs={"do_sample": False}, report_to=[], use_cpu=True)
    trainer = CurriculumGRPOTrainer(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                                    args=args, train_dataset=Dataset.from_list([{"prompt": "hi"}] * 4),
                                    processing_class=tok)
    prompts = [tok("the cat sat on")["input_ids"], tok("a much longer prompt about tools and grids")["input_ids"]]
    ids, logprobs = trainer._generate_single_turn(prompts, None, {}, 1)
    assert ids == GRPOTrainer._generate_single_turn(trainer, prompts, None, {}, 1)[0] and logprobs is None
    assert len({tuple(i) for i in ids}) > 1 and trainer.engine_calls == 1
    rounds = [p + c + tok(" observation: ok")["input_ids"] for p, c in zip(prompts, ids, strict=True)]
    again = trainer._generate_single_turn(rounds, None, {}, 1)[0]
    assert again == GRPOTrainer._generate_single_turn(trainer, rounds, None, {}, 1)[0]
    assert trainer._engine.stats["reused_tokens"] >= sum(len(p) for p in prompts)  # round 2 reused round 1


def test_grpo_replaces_groups_without_reward_variance_before_the_step(tmp_path, tiny_model_dir, echo_env):
    """Dynamic sampling through TRL's real trainer: the step's first problem gives every episode the same
    reward, so its group is dropped and refilled from the pool, where rewards vary; the step then trains
    on groups that all have variance, and the per-step shares are logged and summarised."""
    from apprentice.data.trajectories import read_parquet
    from apprentice.lm.modeling import load_model, load_tokenizer
    from apprentice.training.rl import train_grpo

    paths = Paths(tmp_path)
    write_data(paths, n=6)
    problems = read_parquet(paths.problems)
    flat = set(problems["problem_id"][:1])  # the first problem: every episode rewarded alike

    def reward(completions, problem_id, **kw):
        return [0.0 if p in flat else float(len(str(c)) % 5) for c, p in zip(completions, problem_id, strict=True)]

    cfg = config(tiny_model_dir, rl={"max_steps": 1, "prompts_per_step": 2, "num_generations": 2,
                                      "max_completion_length": 24, "refill_rounds": 2, "micro_batch_size": 2})
    tok = load_tokenizer(tiny_model_dir, cfg.model.chat_template)
    out = train_grpo(load_model(tiny_model_dir, dtype="fp32"), tok, problems.iloc[:2], paths.rl_model, cfg.rl,
                     dtype="fp32", reward_funcs=[reward], refill=problems.iloc[2:])
    assert out["live_groups_per_step"] == [1.0] and out["groups_sampled"] >= 3  # 2, then refills
    rows = read_metrics(paths.rl_model / METRICS_FILE)
    step = next(r for r in rows if "loss" in r)
    assert step["dynamic/live_groups"] == 1.0 and "dynamic/clipped" in step and step["grad_norm"] > 0
    assert _changed(paths.rl_model, tiny_model_dir) > 0


def test_merged_groups_keep_each_rows_tokens_and_padding_sides():
    """merge_groups: rows of groups from two TRL outputs of different widths come out padded the way TRL
    pads (prompts on the left, completions on the right), each row's tokens unchanged, and the loss
    token count recounted from the merged masks."""
    from apprentice.training.dynamic_sampling import live_groups, merge_groups

    def out(prompt_w, comp_w, adv, base):
        b = len(adv)
        return {"prompt_ids": torch.arange(base, base + b * prompt_w).view(b, prompt_w),
                "prompt_mask": torch.ones(b, prompt_w, dtype=torch.long),
                "completion_ids": torch.arange(base, base + b * comp_w).view(b, comp_w) + 1000,
                "completion_mask": torch.ones(b, comp_w, dtype=torch.long),
                "advantages": torch.tensor(adv), "num_items_in_batch": torch.tensor(b * comp_w)}

    a = out(3, 4, [0.0, 0.0, 1.0, -1.0], 0)
    b = out(5, 2, [0.5, -0.5, 0.0, 0.0], 100)
    assert live_groups(a["advantages"], 2) == [False, True] and live_groups(b["advantages"], 2) == [True, False]
    m = merge_groups([(a, 1), (b, 0)], 2, pad_id=-1)
    assert m["prompt_ids"].shape == (4, 5) and m["completion_ids"].shape == (4, 4)
    assert m["prompt_ids"][0].tolist() == [-1, -1, *a["prompt_ids"][2].tolist()]  # left-padded
    assert m["prompt_mask"][0].tolist() == [0, 0, 1, 1, 1]
    assert m["completion_ids"][2].tolist() == [*b["completion_ids"][0].tolist(), -1, -1]  # right-padded
    assert m["completion_mask"][2].tolist() == [1, 1, 0, 0]
    assert m["advantages"].tolist() == [1.0, -1.0, 0.5, -0.5]
    assert int(m["num_items_in_batch"]) == 2 * 4 + 2 * 2
