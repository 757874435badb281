"""On-policy distillation of the teacher into a student: TRL ``DistillationTrainer`` plus plug-in hooks.

TRL's trainer is fully on-policy: the student samples a completion for each prompt, teacher and
student score it, and the loss is the generalised JSD between the two next-token distributions over
the full vocabulary (``beta``: 0 = forward KL, 1 = reverse KL, 0.5 = JSD), computed in chunks.
``distill.divergence`` picks the divergence; ``distill.beta`` is used for ``jsd``.

Prompts (``distill.prompt_source``):
  * ``problems``: [system, task] of training problems (the first turn of an episode);
  * ``trajectories``: every teacher-trajectory prefix that ends just before an assistant turn, so the
    student is also supervised in mid-episode states (tool responses in its context);
  * ``both`` (default).
Each prompt renders its own family's tool schemas: TRL's trainer takes one fixed ``tools`` list for
all rows, so :class:`ApprenticeDistillationTrainer` renders per row from the ``tools`` column. The
tool loop stays off (``max_tool_calling_iterations`` unused, no callables): distillation targets the
next assistant turn, which needs no environment.

Variants (Guided-OPD, DASH-OPD, TCOD, other losses, OPD->RL annealing): ``distill.variant`` names a
recipe in the one registry, ``apprentice.training.opd.VARIANTS``; the recipe says which trainer runs it
(:func:`make_trainer` dispatches): ``single_turn`` (``vanilla``) is :class:`ApprenticeDistillationTrainer`
below, ``multi_turn`` is built by ``opd.trainer.make_trainer``. A variant can also subclass
:class:`ApprenticeDistillationTrainer`; its hooks:
  * ``rollout(prompts, rows)``: who generates what (mixed teacher/student executors, multi-turn
    episodes through ``rows[i]["spec"]`` and ``apprentice.envs``); must return what TRL's
    ``_generate`` returns: ``(prompt_ids, completion_ids, tool_mask, images, tool_images)`` with
    ``tool_mask[i][t] = 0`` on tokens the student must not be trained on (environment/teacher turns);
  * ``_compute_loss(unwrapped_student, inputs, num_items_in_batch)``: the divergence and its
    weighting (TRL's chunked JSD by default);
  * callbacks (``self.add_callback``) for schedules (annealing, decaying teacher probability);
  * ``self.apprentice_cfg``: the whole typed config (variants read their own params from it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from trl import DistillationTrainer

from apprentice.config import DistillConfig
from apprentice.lm.modeling import autocast
from apprentice.training import common, loggers
from apprentice.training.opd.variants import VARIANTS
from apprentice.training.sampling import EngineSampling

DIVERGENCE_BETA = {"forward_kl": 0.0, "reverse_kl": 1.0}


def divergence_beta(distill: DistillConfig) -> float:
    """TRL's generalised-JSD ``beta`` for ``distill.divergence``."""
    return DIVERGENCE_BETA.get(distill.divergence, distill.beta)


class ApprenticeDistillationTrainer(EngineSampling, DistillationTrainer):
    """``DistillationTrainer`` with per-row tool schemas, the student sampling through the pipeline's
    engine (:mod:`apprentice.training.sampling`; TRL's path, in autocast, where the engine does not
    serve) and the variant hooks above."""

    def __init__(self, *args: Any, apprentice_cfg: Any = None, rollout_dtype: str = "fp32", **kwargs: Any) -> None:
        self.apprentice_cfg = apprentice_cfg
        self._rollout_dtype = rollout_dtype
        self.batch_rows: list[dict[str, Any]] = []
        super().__init__(*args, **kwargs)

    # -- hooks ------------------------------------------------------------------------------------
    def rollout(self, prompts: list[Any], rows: list[dict[str, Any]]) -> tuple:
        """Generate completions for ``prompts`` (vanilla OPD: the student samples one turn)."""
        return super()._generate(prompts)

    # -- TRL overrides ----------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        self.batch_rows = list(inputs)
        return super()._generate_and_score_completions(inputs)

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        """TRL's loss under the run's mixed precision. Why: TRL routes it through
        ``_forward_redirection``, which calls the student's and the teacher's backbones directly and
        so skips the autocast accelerate puts on ``model.forward``; with ``bf16`` on, distillation
        would silently train in fp32 (TRL's own async distillation trainer adds the same context)."""
        with self.accelerator.autocast():
            return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def _generate(self, prompts: list[Any]) -> tuple:
        rows = self.batch_rows if len(self.batch_rows) == len(prompts) else [{} for _ in prompts]
        try:
            return self.rollout(prompts, rows)
        finally:
            self._engine_release()

    def _generate_single_turn(self, prompt_ids: Any, images: Any, multimodal_fields: Any,
                              has_tool_images: bool = False) -> Any:
        if self._engine_serves(images, multimodal_fields):
            return self._engine_sample(prompt_ids)
        with autocast(self._rollout_dtype):
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, has_tool_images)

    def _tokenize_prompts(self, prompts: list[Any]) -> tuple:
        rows = self.batch_rows
        per_row_tools = (len(rows) == len(prompts) and not self.tools and rows and "tools" in rows[0]
                         and isinstance(prompts[0], list))
        if not per_row_tools:
            return super()._tokenize_prompts(prompts)
        tok: Any = self.processing_class  # a tokenizer here (TRL types it as any processor)
        prompt_ids = [
            tok.apply_chat_template(
                conversation=p, tools=row.get("tools") or None, chat_template=self.chat_template,
                add_generation_prompt=True, tokenize=True, return_dict=True, **cast(dict[str, Any], self.chat_template_kwargs or {}),
            )["input_ids"]
            for p, row in zip(prompts, rows, strict=True)
        ]
        return prompt_ids, None, {}


def variant_names() -> list[str]:
    """Every selectable ``distill.variant`` (the registry's names, in its order)."""
    return list(VARIANTS)


def make_trainer(distill: DistillConfig, *, student: Any, teacher: Any, tokenizer: Any, dataset: Any,
                 output_dir: Path, dtype: str, callbacks: Sequence[Any], apprentice_cfg: Any = None) -> Any:
    """The trainer for ``distill.variant``, as its recipe in ``apprentice.training.opd.VARIANTS`` says.

    ``single_turn`` (``vanilla``): :class:`ApprenticeDistillationTrainer`, TRL's plain trainer;
    ``multi_turn`` (every other name): ``opd.trainer.make_trainer`` on the problems of ``dataset`` (its
    ``spec`` column), with the same device settings and callbacks.
    """
    from trl import DistillationConfig

    if distill.variant not in VARIANTS:
        raise ValueError(f"unknown distill.variant '{distill.variant}'; choose from {variant_names()}")
    # the builders read only cfg.distill: without the whole config, the distill section stands in
    recipe = VARIANTS[distill.variant](apprentice_cfg if apprentice_cfg is not None else SimpleNamespace(distill=distill))
    if recipe.trainer == "single_turn":
        # one generation of batch_size prompts per step (TRL buffers it), the loss in micro-batches: the student's
        # activations over the padded prompts are the phase's peak memory, not the generation
        micro = min(distill.micro_batch_size, distill.batch_size)
        args = common.trl_args(
            DistillationConfig, output_dir, dtype=dtype, max_steps=distill.max_steps, batch_size=micro,
            grad_accum=distill.batch_size // micro,
            learning_rate=distill.learning_rate, save_steps=distill.save_steps, seed=distill.seed,
            max_completion_length=distill.max_completion_length, beta=divergence_beta(distill),
            remove_unused_columns=False,
        )
        return ApprenticeDistillationTrainer(
            model=student, teacher_model=teacher, args=args, train_dataset=dataset, processing_class=tokenizer,
            callbacks=list(callbacks), apprentice_cfg=apprentice_cfg, rollout_dtype="bf16" if args.bf16 else "fp32",
        )
    if apprentice_cfg is None:
        raise ValueError(f"distill.variant '{distill.variant}' needs the whole config (apprentice_cfg=...)")
    from apprentice.envs.base import ProblemSpec
    from apprentice.training.opd.trainer import make_trainer as make_opd_trainer

    specs = [ProblemSpec.from_json(s) for s in dict.fromkeys(dataset["spec"])]
    return make_opd_trainer(
        recipe, student=student, specs=specs, tokenizer=tokenizer,
        # privileged self-distillation: the teacher is the student itself plus privileged context
        teacher=None if getattr(recipe, "privileged", "none") != "none" else teacher,
        output_dir=str(output_dir), max_steps=distill.max_steps, batch_size=distill.batch_size,
        learning_rate=distill.learning_rate, beta=divergence_beta(distill), seed=distill.seed, dtype=dtype,
        save_steps=distill.save_steps, temperature=distill.opd.temperature,
        turn_tokens=distill.max_completion_length, max_turns=distill.opd.max_turns, callbacks=callbacks,
    )


# ---- prompts --------------------------------------------------------------------------------------
def problem_prompts(problems: Any) -> list[dict[str, Any]]:
    """[system, task] prompt of each problem, with its family's tool schemas."""
    from apprentice.envs import FAMILIES
    from apprentice.envs.base import ProblemSpec

    rows = []
    for r in problems.to_dict("records"):
        cls = FAMILIES[r["family"]]
        env = cls()
        task = env.reset(spec=ProblemSpec.from_json(r["spec"]))
        rows.append({"prompt": [{"role": "system", "content": cls.system_prompt}, {"role": "user", "content": task}],
                     "tools": cls.tool_schemas(), "spec": r["spec"], "environment": r["family"]})
    return rows


def trajectory_prompts(trajectories: Any) -> list[dict[str, Any]]:
    """Every prefix of each trajectory that ends right before an assistant turn (after the task)."""
    import json

    from apprentice.training.sft import episode_start

    rows = []
    for r in trajectories.to_dict("records"):
        messages, tools = json.loads(r["messages"]), json.loads(r["tools"])
        for j in range(episode_start(messages), len(messages)):
            if messages[j].get("role") == "assistant":
                rows.append({"prompt": messages[:j], "tools": tools, "spec": r["spec"], "environment": r["family"]})
    return rows


def build_dataset(rows: Sequence[dict[str, Any]]) -> Any:
    from datasets import Dataset, Features, Json, List, Value

    if not rows:
        raise ValueError("no distillation prompts: problems and teacher trajectories are both empty")
    feats = Features({"prompt": List(Json()), "tools": List(Json()), "spec": Value("string"),
                      "environment": Value("string")})
    return Dataset.from_list([{k: r[k] for k in feats} for r in rows], features=feats)


# ---- training -------------------------------------------------------------------------------------
def train_distill(student: Any, teacher: Any, tokenizer: Any, rows: Sequence[dict[str, Any]], final_dir: Path,
                  distill: DistillConfig, *, dtype: str = "auto", stamp: dict[str, Any] | None = None,
                  callbacks: Sequence[Any] = (), apprentice_cfg: Any = None,
                  extra_files: dict[str, str] | None = None, stage: str = "distill") -> dict[str, Any]:
    """On-policy distillation of ``teacher`` into ``student`` (paths or models); write ``final_dir``."""
    from transformers import set_seed

    from apprentice.lm.modeling import load_model

    t0 = time.time()
    final_dir = Path(final_dir)
    work = common.work_dir_for(final_dir)
    work.mkdir(parents=True, exist_ok=True)
    metrics = work / common.METRICS_FILE
    set_seed(distill.seed)
    if isinstance(student, str | Path):
        student = load_model(student, dtype="fp32")
    if isinstance(teacher, str | Path):
        teacher = load_model(teacher, dtype="fp32")
    student.train()
    teacher.eval()
    dataset = build_dataset(rows)
    ckpt = common.last_checkpoint(work)
    common.trim_metrics(metrics, stage, common.checkpoint_step(ckpt))
    logged = common.MetricsCallback(metrics, stage)  # after the trim: it continues the kept rows
    trainer = make_trainer(distill, student=student, teacher=teacher, tokenizer=tokenizer, dataset=dataset,
                           output_dir=work, dtype=dtype, apprentice_cfg=apprentice_cfg,
                           callbacks=[logged, *loggers.callbacks(stage, logged), *callbacks])
    out = trainer.train(resume_from_checkpoint=ckpt)
    common.finalize(trainer, tokenizer, final_dir, work, stamp=stamp or {}, metrics=metrics,
                    extra_files=extra_files)
    return {
        "model": str(final_dir),
        "variant": distill.variant,
        "divergence": distill.divergence,
        "beta": divergence_beta(distill),
        "steps": int(trainer.state.global_step),
        "resumed_from_step": common.checkpoint_step(ckpt),
        "train_loss": common.summary_train_loss(final_dir / common.METRICS_FILE, stage, out.training_loss),
        "prompts": len(dataset),
        "sampler": "engine" if trainer.engine_calls else "trl-generate",  # apprentice.training.sampling
        "wall_s": round(time.time() - t0, 1),
        "metrics": str(final_dir / common.METRICS_FILE),
    }
