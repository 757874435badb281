"""Every distillation variant selectable as ``distill.variant``: each maps the typed params to a :class:`Recipe`.

:data:`VARIANTS` is the one registry of them: the config accepts exactly its names
(:func:`apprentice.config.variant_names`), and the distill stage's trainer dispatch
(:func:`apprentice.training.distill.make_trainer`) builds the trainer its recipe names. Each name maps
to one builder and so to one trainer:

* ``single_turn`` (``vanilla``): TRL's on-policy ``DistillationTrainer`` as is, the student writing one
  next assistant turn per prompt (:class:`apprentice.training.distill.ApprenticeDistillationTrainer`);
  it reads none of the recipe's other fields;
* ``multi_turn`` (every other name): the mixed-rollout trainer (:mod:`apprentice.training.opd.trainer`)
  over whole episodes, shared by the variants; a recipe is the whole difference between them (who acts,
  the horizon, how the loss is weighted and mixed with RL, what the teacher sees).

Add a variant by adding a builder and its entry in :data:`VARIANTS`. This module imports no torch at
load (the config reads the registry's names when it validates): the loss-side types are imported
where a recipe is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from apprentice.training.opd.executors import (
    DASHExecutor,
    Executor,
    GuidedExecutor,
    TCODExecutor,
    VanillaExecutor,
)
from apprentice.training.opd.privileged import Kind
from apprentice.training.opd.schedules import DecaySchedule, DepthSchedule

if TYPE_CHECKING:
    from apprentice.training.opd.annealing import ObjectiveMixer
    from apprentice.training.opd.weighting import Mode

#: Which trainer runs a variant (see the module docstring).
Trainer = Literal["single_turn", "multi_turn"]


def _opd_only() -> ObjectiveMixer:
    from apprentice.training.opd.annealing import OPD_ONLY

    return OPD_ONLY


@dataclass
class Recipe:
    """Everything that distinguishes one distillation variant from another."""

    name: str
    trainer: Trainer = "multi_turn"
    executor: Executor = field(default_factory=VanillaExecutor)
    mixer: ObjectiveMixer = field(default_factory=_opd_only)
    weighting: Mode = "token"
    sod_alpha: float = 0.0
    privileged: Kind = "none"  # != none: teacher = frozen copy of the student + privileged context
    self_teacher_sync_steps: int = 0  # privileged: re-copy the student into the teacher every N steps
    samples_per_problem: int = 1  # GRPO groups (ATOD/GRPO need >= 2)
    train_teacher_turns: bool = False
    temperature: float | None = None  # rollout sampling temperature (None: the trainer's default)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "trainer": self.trainer, "executor": repr(self.executor), "mixer": repr(self.mixer),
                "weighting": self.weighting, "sod_alpha": self.sod_alpha, "privileged": self.privileged,
                "samples_per_problem": self.samples_per_problem, "train_teacher_turns": self.train_teacher_turns}


def _steps(n: int, cfg: Any) -> int:
    return n if n > 0 else max(int(cfg.distill.max_steps), 1)


def _base(cfg: Any, name: str, **kw: Any) -> Recipe:
    o = cfg.distill.opd
    kw.setdefault("samples_per_problem", o.samples_per_problem)
    return Recipe(name=name, weighting=o.weighting, sod_alpha=o.sod_alpha,
                  train_teacher_turns=o.train_teacher_turns, temperature=o.temperature, **kw)


def single_turn(cfg: Any) -> Recipe:
    """TRL's single-turn on-policy distillation (the pipeline's default): the student samples one next
    turn per prompt and is trained on the divergence from the teacher on it."""
    return Recipe(name="vanilla", trainer="single_turn")


def opd(cfg: Any) -> Recipe:
    """Multi-turn vanilla OPD: the student acts every turn of a whole episode, tools executed."""
    return _base(cfg, "opd")


def guided(cfg: Any) -> Recipe:
    o = cfg.distill.opd
    p = DecaySchedule(o.guided_p0, _steps(o.guided_decay_steps, cfg), o.guided_decay)
    return _base(cfg, "guided", executor=GuidedExecutor(p=p, seed=cfg.distill.seed))


def dash(cfg: Any) -> Recipe:
    o = cfg.distill.opd
    ex = DASHExecutor(drift_threshold=o.dash_drift_threshold, recovery_threshold=o.dash_recovery_threshold,
                      allowance=o.dash_allowance, scale=o.dash_scale)
    return _base(cfg, "dash", executor=ex)


def tcod(cfg: Any) -> Recipe:
    o = cfg.distill.opd
    depth = DepthSchedule(o.tcod_start_turns, max(o.tcod_end_turns, o.tcod_start_turns),
                          _steps(o.tcod_steps, cfg), o.tcod_schedule)
    return _base(cfg, "tcod", executor=TCODExecutor(depth=depth))


def atod(cfg: Any) -> Recipe:
    from apprentice.training.opd.annealing import ObjectiveMixer

    o = cfg.distill.opd
    mixer = ObjectiveMixer(_steps(o.anneal_steps, cfg), opd_start=1.0, opd_end=o.anneal_opd_end,
                           rl_start=0.0, rl_end=o.anneal_rl_end, kind=o.anneal_kind)
    return _base(cfg, "atod", mixer=mixer, samples_per_problem=max(o.samples_per_problem, 2))


def grpo(cfg: Any) -> Recipe:
    """Baseline for claim (a): the same rollouts and machinery with the RL term only (no teacher signal)."""
    from apprentice.training.opd.annealing import RL_ONLY

    return _base(cfg, "grpo", mixer=RL_ONLY, samples_per_problem=max(cfg.distill.opd.samples_per_problem, 2))


def privileged(cfg: Any) -> Recipe:
    o = cfg.distill.opd
    return _base(cfg, "privileged", privileged=o.privileged_context, self_teacher_sync_steps=o.privileged_sync_steps)


#: ``opd`` is multi-turn vanilla OPD, on which the other multi-turn variants build; ``vanilla`` is TRL's
#: single-turn trainer (the default). The one registry of ``distill.variant`` names: name -> recipe builder.
VARIANTS: dict[str, Callable[[Any], Recipe]] = {
    "vanilla": single_turn,
    "opd": opd,
    "guided": guided,
    "dash": dash,
    "tcod": tcod,
    "atod": atod,
    "privileged": privileged,
    "grpo": grpo,
}


def recipe_for(cfg: Any) -> Recipe:
    name = cfg.distill.variant
    if name not in VARIANTS:
        raise ValueError(f"unknown distill.variant '{name}'; choose from {sorted(VARIANTS)} "
                         "(set it in params.yaml or with --set distill.variant=...)")
    return VARIANTS[name](cfg)
