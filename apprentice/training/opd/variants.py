"""The OPD variants selectable as ``distill.variant``: each maps the typed params to a :class:`Recipe`.

A recipe is the whole difference between variants (who acts, the horizon, how the loss is weighted and
mixed with RL, what the teacher sees); the trainer (:mod:`apprentice.training.opd.trainer`) is shared.
``VARIANTS`` is the registry the distill stage looks names up in; add a variant by adding a builder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from apprentice.training.opd.annealing import OPD_ONLY, RL_ONLY, ObjectiveMixer
from apprentice.training.opd.executors import (
    DASHExecutor,
    Executor,
    GuidedExecutor,
    TCODExecutor,
    VanillaExecutor,
)
from apprentice.training.opd.privileged import Kind
from apprentice.training.opd.schedules import DecaySchedule, DepthSchedule
from apprentice.training.opd.weighting import Mode


@dataclass
class Recipe:
    """Everything that distinguishes one OPD variant from another."""

    name: str
    executor: Executor = field(default_factory=VanillaExecutor)
    mixer: ObjectiveMixer = OPD_ONLY
    weighting: Mode = "token"
    sod_alpha: float = 0.0
    privileged: Kind = "none"  # != none: teacher = frozen copy of the student + privileged context
    self_teacher_sync_steps: int = 0  # privileged: re-copy the student into the teacher every N steps
    samples_per_problem: int = 1  # GRPO groups (ATOD/GRPO need >= 2)
    train_teacher_turns: bool = False
    temperature: float | None = None  # rollout sampling temperature (None: the trainer's default)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "executor": repr(self.executor), "mixer": repr(self.mixer),
                "weighting": self.weighting, "sod_alpha": self.sod_alpha, "privileged": self.privileged,
                "samples_per_problem": self.samples_per_problem, "train_teacher_turns": self.train_teacher_turns}


def _steps(n: int, cfg: Any) -> int:
    return n if n > 0 else max(int(cfg.distill.max_steps), 1)


def _base(cfg: Any, name: str, **kw: Any) -> Recipe:
    o = cfg.distill.opd
    kw.setdefault("samples_per_problem", o.samples_per_problem)
    return Recipe(name=name, weighting=o.weighting, sod_alpha=o.sod_alpha,
                  train_teacher_turns=o.train_teacher_turns, temperature=o.temperature, **kw)


def vanilla(cfg: Any) -> Recipe:
    return _base(cfg, "vanilla")


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
    o = cfg.distill.opd
    mixer = ObjectiveMixer(_steps(o.anneal_steps, cfg), opd_start=1.0, opd_end=o.anneal_opd_end,
                           rl_start=0.0, rl_end=o.anneal_rl_end, kind=o.anneal_kind)
    return _base(cfg, "atod", mixer=mixer, samples_per_problem=max(o.samples_per_problem, 2))


def grpo(cfg: Any) -> Recipe:
    """Baseline for claim (a): the same rollouts and machinery with the RL term only (no teacher signal)."""
    return _base(cfg, "grpo", mixer=RL_ONLY, samples_per_problem=max(cfg.distill.opd.samples_per_problem, 2))


def privileged(cfg: Any) -> Recipe:
    o = cfg.distill.opd
    return _base(cfg, "privileged", privileged=o.privileged_context, self_teacher_sync_steps=o.privileged_sync_steps)


#: ``opd`` is multi-turn vanilla OPD under the name the distill stage can select (its own built-in
#: ``vanilla`` is TRL's single-turn trainer and wins on that name); ``vanilla`` is kept for direct use.
VARIANTS: dict[str, Callable[[Any], Recipe]] = {
    "opd": vanilla,
    "vanilla": vanilla,
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
