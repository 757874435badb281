"""The multi-turn OPD trainer: TRL's ``DistillationTrainer`` with mixed-executor episode rollouts.

Why a subclass of ``DistillationTrainer`` (and not GRPOTrainer's ``rollout_func``): read in TRL 1.16,
``rollout_func`` feeds GRPO's *reward/advantage* loss: it has no teacher and no per-token divergence, so
OPD on top of it would re-implement the distillation loss. ``DistillationTrainer`` already owns the
teacher, the generalized-JSD kernel (``ChunkedDivergenceFunction``), the generation-batch buffering
and the metrics plumbing, but its rollout is one student completion (its tool loop has the student
act every turn and cannot hand turns to the teacher). So we override exactly two methods:

  * ``_generate_and_score_completions``: run a mixed rollout (``MixedPolicy`` over the pipeline's
    rollout engine: the executor picks who acts each turn, environment tools really run), render each
    episode into ``prompt_ids``/``completion_ids`` with a loss mask over the *student-written* assistant
    tokens (tool outputs and teacher turns are context, as TRL's ``tool_mask`` does for tool outputs);
  * ``_compute_loss``: TRL's own hidden-state + kernel path, but keeping the per-token divergences so we
    can weight them (token vs turn-balanced, SOD), log KL per turn index, and add the annealed GRPO term
    (ATOD). The privileged self-teacher reads a different prompt (same completion tokens), so the
    teacher forward takes its own ``teacher_prompt_ids``.

Diagnostics (one JSONL row per step through ``training.common.MetricsCallback``): ``opd/kl_turn_<k>``
(mean per-token divergence on the student's turn k), ``opd/kl_slope`` (least-squares slope of that
over k), ``opd/teacher_share``, ``opd/switches``, ``opd/success``, ``opd/reward``, ``opd/traj_turns``,
``opd/w_opd``, ``opd/w_rl``, ``opd/loss_opd``, ``opd/loss_rl``, ``opd/horizon``.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from trl import DistillationConfig, DistillationTrainer
from trl.trainer.utils import pad, selective_log_softmax

from apprentice.envs import Environment, ProblemSpec
from apprentice.envs.base import derive_seed
from apprentice.policies.hf_cached import CachedHFPolicy
from apprentice.rollout.episodes import run_episodes
from apprentice.training.opd.annealing import group_advantages, policy_gradient_loss, token_share
from apprentice.training.opd.losses import chunked_per_token_divergence
from apprentice.training.opd.mixed import (
    MixedPolicy,
    encode_trajectory,
    episode_stats,
    oracle_context,
    specs_from_rows,
)
from apprentice.training.opd.variants import Recipe
from apprentice.training.opd.weighting import loss_weights


def problems_dataset(specs: Sequence[ProblemSpec], env_factory: Callable[[ProblemSpec], Environment] | None = None):
    """A ``datasets.Dataset`` with ``spec`` (JSON) and ``prompt`` (system + task) columns."""
    from datasets import Dataset

    from apprentice.envs import FAMILIES

    rows = []
    for s in specs:
        env = env_factory(s) if env_factory else FAMILIES[s.family]()
        first = env.reset(spec=s)
        rows.append({"spec": s.to_json(),
                     "prompt": [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": first}]})
    return Dataset.from_list(rows)


class OPDTrainer(DistillationTrainer):
    """``DistillationTrainer`` whose rollouts are whole mixed-executor episodes (module docstring)."""

    def __init__(self, *args: Any, recipe: Recipe, env_factory: Callable[[ProblemSpec], Environment] | None = None,
                 rollout_dtype: str = "fp32", max_turns: int = 0, turn_tokens: int = 48,
                 max_completion_tokens: int = 1024, **kwargs: Any) -> None:
        if recipe.privileged != "none" and kwargs.get("teacher_model") is None:
            # Self-distillation: the teacher is a frozen copy of the student (re-synced every N steps).
            kwargs["teacher_model"] = copy.deepcopy(kwargs.get("model", args[0] if args else None))
        super().__init__(*args, **kwargs)
        self.recipe = recipe
        self.env_factory = env_factory
        self.rollout_dtype = rollout_dtype
        self.max_turns = max_turns
        self.turn_tokens = turn_tokens
        self.max_completion_tokens = max_completion_tokens
        for p in self.teacher_model.parameters():
            p.requires_grad_(False)

    # -- TRL removes dataset columns the trainer does not declare; ours needs the spec -------------------
    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["prompt", "spec"]  # type: ignore[assignment]  # TRL declares it None

    # -- rollout -------------------------------------------------------------------------------------
    def _sync_self_teacher(self, step: int) -> None:
        n = self.recipe.self_teacher_sync_steps
        if self.recipe.privileged != "none" and n > 0 and step > 0 and step % n == 0:
            student = self.accelerator.unwrap_model(self.model)
            self.accelerator.unwrap_model(self.teacher_model).load_state_dict(student.state_dict())

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        device = self.accelerator.device
        step = int(self.state.global_step)
        self._sync_self_teacher(step)
        specs = specs_from_rows(inputs)
        tok = self._tokenizer
        student = self.accelerator.unwrap_model(self.model)
        teacher = self.accelerator.unwrap_model(self.teacher_model)
        seed = derive_seed(self.args.seed, "opd-rollout", step)
        common: dict[str, Any] = dict(temperature=self.temperature, max_new_tokens=self.turn_tokens, dtype=self.rollout_dtype,
                      batch_size=max(len(specs) * self.recipe.samples_per_problem, 1))
        mixed = MixedPolicy(
            student=CachedHFPolicy(student, tok, seed=seed % 2**31, policy_id="student", **common),
            teacher=CachedHFPolicy(teacher, tok, seed=(seed + 1) % 2**31, policy_id="teacher", **common),
            executor=self.recipe.executor, step=step, privileged=self.recipe.privileged, dtype=self.rollout_dtype,
        )
        horizon = self.recipe.executor.horizon(step) or 0
        max_turns = min(x for x in (horizon, self.max_turns) if x > 0) if (horizon or self.max_turns) else 0
        was_training = student.training
        student.eval()
        try:
            trajs = run_episodes(specs, mixed, samples_per_problem=self.recipe.samples_per_problem,
                                 max_turns=max_turns, batch_size=common["batch_size"], progress=False,
                                 seed=seed % 2**31, env_factory=self.env_factory)
        finally:
            student.train(was_training)

        encoded = []
        for tr in trajs:
            ctx = None
            if self.recipe.privileged != "none":
                ctx = oracle_context(ProblemSpec.from_json(tr.spec), self.env_factory)
            encoded.append(encode_trajectory(tr, tok, privileged=self.recipe.privileged, context=ctx,
                                             train_teacher_turns=self.recipe.train_teacher_turns,
                                             max_length=self.max_completion_tokens))

        # diagnostics of the rollout
        m = self._metrics["train"]
        stats = [episode_stats(t) for t in trajs]
        for key in ("teacher_share", "switches", "success", "reward", "traj_turns"):
            m[f"opd/{key}"].append(sum(s[key] for s in stats) / len(stats))
        m["opd/horizon"].append(float(max_turns))

        def padded(seqs, value, side):
            return pad([torch.tensor(s, dtype=torch.long) for s in seqs], padding_value=value,
                       padding_side=side).to(device)

        pad_id = tok.pad_token_id
        out: dict[str, Any] = {
            "prompt_ids": padded([e.prompt_ids for e in encoded], pad_id, "left"),
            "prompt_mask": padded([[1] * len(e.prompt_ids) for e in encoded], 0, "left"),
            "completion_ids": padded([e.completion_ids for e in encoded], pad_id, "right"),
            "completion_mask": padded([[1] * len(e.completion_ids) for e in encoded], 0, "right"),
            "tool_mask": padded([e.loss_mask for e in encoded], 0, "right"),
            "turn_index": padded([e.turn_index for e in encoded], -1, "right"),
            "episode": torch.arange(len(encoded), device=device),
        }
        if self.recipe.privileged != "none":
            out["teacher_prompt_ids"] = padded([e.teacher_prompt_ids for e in encoded], pad_id, "left")
            out["teacher_prompt_mask"] = padded([[1] * len(e.teacher_prompt_ids) for e in encoded], 0, "left")
        rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
        groups = torch.tensor([specs.index(ProblemSpec.from_json(t.spec)) for t in trajs])
        out["advantages"] = group_advantages(rewards, groups).to(device)
        # as TRL counts it: loss tokens of the whole generation batch, over all processes (gathered)
        out["num_items_in_batch"] = self.accelerator.gather((out["completion_mask"] * out["tool_mask"]).sum()).sum()
        return out

    # -- loss ----------------------------------------------------------------------------------------
    def _compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
        comp = inputs["completion_ids"]
        K = comp.size(1)
        loss_mask = (inputs["completion_mask"] * inputs["tool_mask"]).bool()
        s_ids = torch.cat([inputs["prompt_ids"], comp], 1)
        s_att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        h_s = self._get_last_hidden_state(unwrapped_student, s_ids, s_att, K)
        t_prompt = inputs.get("teacher_prompt_ids", inputs["prompt_ids"])
        t_pmask = inputs.get("teacher_prompt_mask", inputs["prompt_mask"])
        unwrapped_teacher = self.accelerator.unwrap_model(self.teacher_model)
        unwrapped_teacher.eval()
        with torch.no_grad():
            h_t = self._get_last_hidden_state(unwrapped_teacher, torch.cat([t_prompt, comp], 1),
                                              torch.cat([t_pmask, inputs["completion_mask"]], 1), K)
        sel = loss_mask.reshape(-1)
        hs = h_s.reshape(-1, h_s.size(-1))[sel]
        ht = h_t.reshape(-1, h_t.size(-1))[sel]
        s_head = unwrapped_student.get_output_embeddings()
        t_head = unwrapped_teacher.get_output_embeddings()
        div, entropy = chunked_per_token_divergence(hs, s_head, ht.to(hs.dtype), t_head, self.beta, self.temperature)

        B = comp.size(0)
        episode = inputs["episode"].view(B, 1).expand(B, K).reshape(-1)[sel]
        turn = inputs["turn_index"].reshape(-1)[sel]
        turn_ids = episode * 10_000 + turn  # unique per (episode, turn) in this batch
        w = loss_weights(turn_ids, div.detach(), self.recipe.weighting, self.recipe.sod_alpha)
        # w sums to 1 over this micro-batch; token_share rescales to TRL's sum / num_items_in_batch, so the
        # loss is right under gradient accumulation and several processes
        share = token_share(div.numel(), num_items_in_batch)
        loss_opd = (div * w.to(div.dtype)).sum() * share if div.numel() else hs.sum() * 0.0

        step = int(self.state.global_step)
        w_opd, w_rl = self.recipe.mixer.weights(step)
        loss = w_opd * loss_opd
        loss_rl = torch.zeros((), device=loss.device)
        if w_rl > 0 and div.numel():
            logits = s_head(hs).float()
            logps = selective_log_softmax(logits, comp.reshape(-1)[sel])
            adv = inputs["advantages"].view(B, 1).expand(B, K).reshape(-1)[sel]
            loss_rl = policy_gradient_loss(logps, adv) * share
            loss = loss + w_rl * loss_rl

        m = self._metrics["train" if unwrapped_student.training else "eval"]
        m["opd/w_opd"].append(w_opd)
        m["opd/w_rl"].append(w_rl)
        m["opd/loss_opd"].append(float(loss_opd.detach()))
        m["opd/loss_rl"].append(float(loss_rl.detach()))
        per_turn = kl_per_turn(div.detach(), turn)
        for k, v in per_turn.items():
            m[f"opd/kl_turn_{k}"].append(v)
        if len(per_turn) >= 2:
            m["opd/kl_slope"].append(slope(per_turn))
        n_valid = torch.tensor(int(sel.sum()), device=loss.device)
        return loss, entropy.detach().sum(), n_valid


def kl_per_turn(div: torch.Tensor, turn: torch.Tensor) -> dict[int, float]:
    """Mean per-token divergence for each assistant-turn index."""
    acc: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for d, k in zip(div.float().cpu().tolist(), turn.cpu().tolist(), strict=True):
        acc[int(k)][0] += d
        acc[int(k)][1] += 1
    return {k: s / n for k, (s, n) in sorted(acc.items())}


def slope(per_turn: dict[int, float]) -> float:
    """Least-squares slope of KL over turn index (positive = KL grows with depth)."""
    xs, ys = list(per_turn), list(per_turn.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def make_trainer(recipe: Recipe, *, student: Any, teacher: Any | None, tokenizer: Any, specs: Sequence[ProblemSpec],
                 output_dir: str, max_steps: int, batch_size: int, learning_rate: float, beta: float,
                 seed: int = 0, dtype: str = "auto", save_steps: int = 10, temperature: float = 1.0,
                 turn_tokens: int = 48, max_turns: int = 0, callbacks: Sequence[Any] = (),
                 env_factory: Callable[[ProblemSpec], Environment] | None = None,
                 **trl_extra: Any) -> OPDTrainer:
    """An :class:`OPDTrainer` with the pipeline's device settings (``training.common.trl_args``).

    ``batch_size`` counts *problems* per step; each runs ``recipe.samples_per_problem`` episodes.
    """
    from apprentice.lm.modeling import resolve_dtype
    from apprentice.training.common import trl_args

    if recipe.temperature is not None:
        temperature = recipe.temperature
    args = trl_args(DistillationConfig, Path(output_dir), dtype=dtype, max_steps=max_steps, batch_size=batch_size,
                    learning_rate=learning_rate, save_steps=save_steps, seed=seed, beta=beta,
                    temperature=temperature, max_completion_length=turn_tokens, **trl_extra)
    rollout_dtype = "bf16" if resolve_dtype(dtype) == torch.bfloat16 else "fp32"
    return OPDTrainer(
        model=student, teacher_model=teacher, args=args, processing_class=tokenizer,
        train_dataset=problems_dataset(specs, env_factory), callbacks=list(callbacks), recipe=recipe,
        env_factory=env_factory, rollout_dtype=rollout_dtype, max_turns=max_turns, turn_tokens=turn_tokens,
    )
