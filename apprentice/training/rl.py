"""Curriculum GRPO on the environment families: TRL ``GRPOTrainer`` with ``environment_factory``.

TRL runs the multi-turn episode itself: one environment instance per rollout, ``reset(**row)`` with
the dataset row (our ``spec`` column rebuilds the problem), every public method exposed as a tool
(so TRL gets each family through :func:`apprentice.envs.trl_environment`, a facade whose only public
methods are ``reset``, ``get_reward`` and the family's ``@tool`` methods),
``get_reward()`` as the reward (logged as ``rewards/<EnvClass>/mean``). Several families go in as
a dict ``{family: class}`` and each row's ``environment`` column routes it, so one run mixes
families and each prompt shows only its family's tools. No ``rollout_func`` is needed: the
environment loop covers every case the pipeline has (tool-calling episodes with an env reward).

What this module adds on top:
  * **Dynamic sampling** (:class:`~apprentice.training.dynamic_sampling.DynamicSampling`): a group whose
    rewards are all equal is dropped and replaced from a refill pool (the band's other problems) before
    the gradient step, so a step is not spent on zero advantages.
  * **Curriculum order**: rows are ordered easy -> hard (``apprentice.curriculum``) and TRL's sampler
    keeps that order (``shuffle_dataset=False``: its ``RepeatSampler`` then walks the dataset
    sequentially, each prompt repeated ``num_generations`` times in a row).
  * **Pass-rate filter**: problems the current policy always or never solves are dropped before
    training (``apprentice.curriculum.keep_for_grpo``), estimated from sampled probe rollouts through
    the same engine that evaluates (``apprentice.rollout.episodes.run_episodes``).
  * **bf16 rollouts**: TRL generates outside autocast, i.e. in fp32, even with ``bf16=True``;
    :class:`CurriculumGRPOTrainer` wraps generation in autocast (faster wherever bf16 is, see
    :mod:`apprentice.lm.dtypes`). Trained weights stay fp32.
  * **Scoring without padding, the common prompt prefix once**
    (:class:`~apprentice.training.packing.SharedPromptScoring`): TRL's padded block (prompts left-padded,
    completions right-padded to ``max_completion_length``, the LM head on every position) becomes one
    flattened row holding the micro-batch's shared system prompt and tool schemas once.
  * **Sampler: the pipeline's engine** (:mod:`apprentice.training.sampling`): TRL's tool loop hands
    ``_generate_single_turn`` token ids, and each tool round reuses the keys/values of the episode's
    earlier rounds, where TRL's plain path re-encodes the whole episode every round.

Prompt shape: TRL appends ``reset()``'s return to the last user message *without a
separator*. The dataset's user message is therefore empty and ``reset()`` supplies the whole task
text, which reproduces exactly the ``[system, user(task)]`` start the rollout engine (and hence the
SFT data) uses. ``max_completion_length`` budgets the *whole* episode, tool responses included
(~50 tokens per tool step with the compact template).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
from trl import GRPOTrainer

from apprentice.config import RLConfig
from apprentice.lm.modeling import autocast
from apprentice.training import common, loggers
from apprentice.training.dynamic_sampling import DynamicSampling
from apprentice.training.packing import SharedPromptScoring
from apprentice.training.sampling import EngineSampling


class CurriculumGRPOTrainer(DynamicSampling, EngineSampling, SharedPromptScoring, GRPOTrainer):
    """``GRPOTrainer`` sampling through the pipeline's engine (TRL's own loss, sampler and tool loop),
    replacing groups without reward variance before the step (:mod:`apprentice.training.dynamic_sampling`),
    scoring each micro-batch as one flattened row over one copy of its common prompt prefix.

    Overrides TRL's private ``_generate_single_turn`` and ``_get_per_token_logps_and_entropies`` and
    wraps ``_generate`` (TRL pinned exactly; contract test in ``tests/unit/test_library_contracts.py``):
    same arguments and returns as TRL's plain ``generate`` path (:mod:`apprentice.training.sampling`)
    and its padded scoring (:class:`~apprentice.training.packing.SharedPromptScoring`).
    """

    def __init__(self, *args: Any, rollout_dtype: str = "fp32", **kwargs: Any) -> None:
        self._rollout_dtype = rollout_dtype
        super().__init__(*args, **kwargs)

    def _generate(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._generate(*args, **kwargs)
        finally:
            self._engine_release()

    def _generate_single_turn(self, prompt_ids: Any, images: Any, multimodal_fields: Any, num_generations: int,
                              has_tool_images: bool = False) -> Any:
        if self._engine_serves(images, multimodal_fields):
            return self._engine_sample(prompt_ids), None
        with autocast(self._rollout_dtype):
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)


def environment_classes(families: Sequence[str]) -> dict[str, Any]:
    from apprentice.envs import resolve

    return {f: resolve(f) for f in sorted(set(families))}  # resolve names the known families and the fix


def build_dataset(problems: pd.DataFrame) -> Any:
    """One row per problem, in the given order: prompt = [system, user('')], spec, environment."""
    from datasets import Dataset

    rows = dataset_rows(problems)
    if not rows:
        raise ValueError("no RL problems left after the curriculum filter; check data/iter_k/problems.parquet")
    return Dataset.from_list(rows)


def dataset_rows(problems: pd.DataFrame) -> list[dict[str, Any]]:
    """The dataset rows of ``problems`` (what TRL hands ``_generate_and_score_completions``)."""
    if problems.empty:
        return []
    classes = environment_classes(problems["family"].tolist())
    return [
        {
            "prompt": [{"role": "system", "content": classes[r["family"]].system_prompt},
                       {"role": "user", "content": ""}],
            "spec": r["spec"],
            "environment": r["family"],
            "problem_id": r["problem_id"],
        }
        for r in problems.to_dict("records")
    ]


def reward_trend(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """First/last/mean reward and the least-squares slope per step (the 'positive trend' check)."""
    pts = [(r["step"], r["reward"]) for r in rows if "reward" in r]
    if not pts:
        return {}
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in pts) / var if var else 0.0
    return {"reward_first": ys[0], "reward_last": ys[-1], "reward_mean": my, "reward_slope": slope}


def signal_share(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Share of GRPO steps that could move the model: some group had reward variance
    (``frac_reward_zero_std`` < 1) and the gradient was not zero. A step where every group's rewards
    are equal has zero advantages, hence zero policy gradient (with ``beta`` = 0): RL then only
    costs time. The RL stage reports this so a run that learned nothing says so."""
    steps = [r for r in rows if "frac_reward_zero_std" in r]
    if not steps:
        return {}
    live = [r for r in steps if float(r["frac_reward_zero_std"]) < 1 and float(r.get("grad_norm", 0) or 0) > 0]
    return {"signal_steps": len(live), "logged_steps": len(steps), "signal_share": len(live) / len(steps)}


def dynamic_summary(log: list[dict[str, float]]) -> dict[str, Any]:
    """Per step of this run: the share of groups with reward variance and of clipped episodes (the
    two numbers RL is judged by: a step with no live group cannot move the model, a clipped episode
    scores 0 whatever it did), and the groups sampled to fill the steps."""
    if not log:
        return {}
    return {"live_groups_per_step": [round(s["live_groups"], 3) for s in log],
            "clipped_per_step": [round(s["clipped"], 3) for s in log],
            "live_groups_mean": round(sum(s["live_groups"] for s in log) / len(log), 4),
            "clipped_mean": round(sum(s["clipped"] for s in log) / len(log), 4),
            "groups_sampled": int(sum(s["groups_sampled"] for s in log))}


def train_grpo(model: Any, tokenizer: Any, problems: pd.DataFrame, final_dir: Path, rl: RLConfig, *,
               dtype: str = "auto", stamp: dict[str, Any] | None = None, callbacks: Sequence[Any] = (),
               reward_funcs: Sequence[Any] = (), extra_files: dict[str, str] | None = None,
               stage: str = "rl", refill: pd.DataFrame | None = None) -> dict[str, Any]:
    """GRPO over ``problems`` (already in curriculum order) from ``model``; write ``final_dir``.

    ``refill``: the problems a group without reward variance is replaced from (``rl.refill_rounds``
    rounds a step; none: the problems GRPO does not reach, then the rest, in order).

    ``reward_funcs`` are added to the environments' own rewards (TRL sums them); the stage passes
    none, the environment reward alone drives RL.
    """
    from transformers import set_seed
    from trl import GRPOConfig

    from apprentice.envs import trl_environment
    from apprentice.lm.modeling import load_model

    t0 = time.time()
    final_dir = Path(final_dir)
    work = common.work_dir_for(final_dir)
    work.mkdir(parents=True, exist_ok=True)
    metrics = work / common.METRICS_FILE
    set_seed(rl.seed)
    dataset = build_dataset(problems)
    classes = environment_classes(problems["family"].tolist())
    if isinstance(model, str | Path):
        model = load_model(model, dtype="fp32")
    model.train()
    total = rl.prompts_per_step * rl.num_generations  # episodes per optimizer step (one generation batch)
    micro = min(rl.micro_batch_size, total)
    args = common.trl_args(
        GRPOConfig, work, dtype=dtype, max_steps=rl.max_steps, batch_size=micro, grad_accum=total // micro,
        learning_rate=rl.learning_rate, save_steps=rl.save_steps, seed=rl.seed,
        num_generations=rl.num_generations, max_completion_length=rl.max_completion_length,
        max_tool_calling_iterations=rl.max_tool_calls, beta=rl.beta, shuffle_dataset=False,
        remove_unused_columns=False,
    )
    ckpt = common.last_checkpoint(work)
    common.trim_metrics(metrics, stage, common.checkpoint_step(ckpt))
    logged = common.MetricsCallback(metrics, stage)  # after the trim: it continues the kept rows
    trainer = CurriculumGRPOTrainer(
        model=model, reward_funcs=list(reward_funcs) or None, args=args, train_dataset=dataset,
        processing_class=tokenizer, environment_factory={f: trl_environment(c) for f, c in classes.items()},
        callbacks=[logged, *loggers.callbacks(stage, logged), *callbacks],
        rollout_dtype="bf16" if args.bf16 else "fp32",
    )
    used = rl.max_steps * rl.prompts_per_step
    pool = refill if refill is not None else pd.concat([problems.iloc[used:], problems.iloc[:used]])
    trainer.set_refill_pool(dataset_rows(pool), rl.refill_rounds)
    out = trainer.train(resume_from_checkpoint=ckpt)
    rows = common.read_metrics(metrics)
    common.finalize(trainer, tokenizer, final_dir, work, stamp=stamp or {}, metrics=metrics,
                    extra_files=extra_files)
    return {
        "model": str(final_dir),
        "steps": int(trainer.state.global_step),
        "resumed_from_step": common.checkpoint_step(ckpt),
        "train_loss": common.summary_train_loss(final_dir / common.METRICS_FILE, stage, out.training_loss),
        "problems": len(dataset),
        "sampler": "engine" if trainer.engine_calls else "trl-generate",  # see the module docstring
        **reward_trend([r for r in rows if "train_loss" not in r]),
        **signal_share([r for r in rows if "train_loss" not in r]),
        **dynamic_summary(trainer.dynamic_log),
        "wall_s": round(time.time() - t0, 1),
        "metrics": str(final_dir / common.METRICS_FILE),
    }
