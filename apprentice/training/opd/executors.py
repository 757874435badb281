"""Executor policies: who acts on each turn of a mixed student/teacher rollout.

Why: in multi-turn on-policy distillation the student's early errors compound and carry it into
states where the teacher's token-level signal is unreliable; letting the teacher act some turns
keeps trajectories where the teacher's supervision holds.

Why hand-written: no library ships turn-level executor switching; TRL's trainers generate every
token with the student. These classes are pure control logic (no torch), so every rule is unit-tested
on synthetic numbers (tests/unit/test_opd_executors.py) and the rollout only asks two questions:

  * ``executor.horizon(step)``: how many turns the episode may last (``None`` = its own budget);
  * ``executor.choose(state, turn, step)``: ``"student"`` or ``"teacher"`` for the next turn, and after
    the turn ``executor.observe(state, actor, discrepancy)`` with the turn's discrepancy.

The discrepancy of a turn is the mean, over the action tokens the *acting* executor generated, of
``log p_actor(token) - log p_other(token)`` (nats; DASH-OPD's "mean log-probability ratio between the
executors"). Only executors with ``needs_discrepancy`` make the rollout pay for scoring the other model.

Rules:
  * vanilla: the student acts every turn (the teacher only scores).
  * Guided-OPD ("On-Policy Distillation with Curriculum Turn-level Guidance for Multi-turn Agents",
    arXiv:2606.15912): the teacher acts a turn with probability p(step), p decaying to exactly 0.
  * DASH-OPD (Discrepancy-Aware Switching with Hysteresis): two CUSUM accumulators with separate
    thresholds (hysteresis in both directions).
    Each turn's discrepancy is normalised to ``z = 1 - exp(-max(d, 0) / scale)`` in [0, 1).
    On student turns drift evidence ``E_d <- max(0, E_d + z - allowance)``; when ``E_d >= drift_threshold``
    the teacher takes over. On teacher turns agreement ``a = 1 - z`` feeds recovery evidence
    ``E_r <- max(0, E_r + a - allowance)``; when ``E_r >= recovery_threshold`` the student resumes.
    Evidence resets on a switch. A single spike adds at most ``1 - allowance`` and decays on calm
    turns, so it cannot switch when the threshold is above ``1 - allowance``; sustained signal does.
  * TCOD ("TCOD: Exploring Temporal Curriculum in On-Policy Distillation for Multi-turn Autonomous
    Agents", arXiv:2604.24005): the student acts, and the exposed depth (turn horizon) grows on a
    :class:`DepthSchedule`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Literal

from apprentice.training.opd.schedules import DecaySchedule, DepthSchedule

Actor = Literal["student", "teacher"]
STUDENT: Actor = "student"
TEACHER: Actor = "teacher"


@dataclass
class EpisodeState:
    """Per-episode executor state; ``actors`` and ``discrepancies`` are the per-turn record."""

    episode: int = 0
    current: Actor = STUDENT
    drift: float = 0.0
    recovery: float = 0.0
    switches: int = 0
    actors: list[Actor] = field(default_factory=list)
    discrepancies: list[float | None] = field(default_factory=list)
    rng: random.Random | None = None

    @property
    def teacher_share(self) -> float:
        return sum(a == TEACHER for a in self.actors) / len(self.actors) if self.actors else 0.0


class Executor:
    """Base: the student acts every turn, no horizon (this *is* vanilla OPD)."""

    name = "vanilla"
    needs_discrepancy = False

    def new_episode(self, episode: int, step: int) -> EpisodeState:
        return EpisodeState(episode=episode)

    def horizon(self, step: int) -> int | None:
        return None

    def choose(self, state: EpisodeState, turn: int, step: int) -> Actor:
        return STUDENT

    def observe(self, state: EpisodeState, actor: Actor, discrepancy: float | None) -> None:
        """Record the finished turn (subclasses update evidence first, then call this)."""
        if state.actors and state.actors[-1] != actor:
            state.switches += 1
        state.actors.append(actor)
        state.discrepancies.append(discrepancy)

    def act(self, state: EpisodeState, turn: int, step: int) -> Actor:
        """``choose`` plus bookkeeping of ``state.current`` (what the rollout calls)."""
        actor = self.choose(state, turn, step)
        state.current = actor
        return actor


class VanillaExecutor(Executor):
    name = "vanilla"


@dataclass
class GuidedExecutor(Executor):
    """Guided-OPD: the teacher acts each turn independently with probability ``p(step)``.

    The per-episode RNG is seeded from (seed, step, episode), so a rerun of a step makes the same
    choices whatever order episodes are processed in.
    """

    p: DecaySchedule = field(default_factory=lambda: DecaySchedule(0.5, 100))
    seed: int = 0
    name: str = "guided"

    def new_episode(self, episode: int, step: int) -> EpisodeState:
        return EpisodeState(episode=episode, rng=random.Random(f"guided:{self.seed}:{step}:{episode}"))

    def choose(self, state: EpisodeState, turn: int, step: int) -> Actor:
        assert state.rng is not None, "call new_episode() first"
        return TEACHER if state.rng.random() < self.p(step) else STUDENT


@dataclass
class DASHExecutor(Executor):
    """DASH-OPD: discrepancy-aware switching with hysteresis (see the module docstring for the rule)."""

    drift_threshold: float = 0.9
    recovery_threshold: float = 0.9
    allowance: float = 0.5
    scale: float = 1.0
    start: Actor = STUDENT
    name: str = "dash"
    needs_discrepancy = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.allowance < 1.0:
            raise ValueError(f"dash allowance must be in [0, 1), got {self.allowance}")
        if self.drift_threshold <= 0 or self.recovery_threshold <= 0 or self.scale <= 0:
            raise ValueError("dash thresholds and scale must be > 0")

    def normalise(self, discrepancy: float) -> float:
        return 1.0 - math.exp(-max(discrepancy, 0.0) / self.scale)

    def new_episode(self, episode: int, step: int) -> EpisodeState:
        return EpisodeState(episode=episode, current=self.start)

    def choose(self, state: EpisodeState, turn: int, step: int) -> Actor:
        return state.current

    def observe(self, state: EpisodeState, actor: Actor, discrepancy: float | None) -> None:
        super().observe(state, actor, discrepancy)
        if discrepancy is None or math.isnan(discrepancy):
            return  # an unparsable/empty turn carries no evidence
        z = self.normalise(discrepancy)
        if actor == STUDENT:
            state.drift = max(0.0, state.drift + z - self.allowance)
            if state.drift >= self.drift_threshold:
                state.current, state.drift, state.recovery = TEACHER, 0.0, 0.0
        else:
            state.recovery = max(0.0, state.recovery + (1.0 - z) - self.allowance)
            if state.recovery >= self.recovery_threshold:
                state.current, state.drift, state.recovery = STUDENT, 0.0, 0.0


@dataclass
class TCODExecutor(Executor):
    """TCOD: the student acts every turn; the exposed depth grows from short to long."""

    depth: DepthSchedule = field(default_factory=lambda: DepthSchedule(1, 8, 100))
    name: str = "tcod"

    def horizon(self, step: int) -> int | None:
        return self.depth(step)


def count_switches(actors: list[Actor]) -> int:
    return sum(a != b for a, b in zip(actors, actors[1:], strict=False))
