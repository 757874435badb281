"""Step schedules for the OPD family: a probability that decays to zero (Guided-OPD, arXiv:2606.15912)
and a depth that grows from short to long (TCOD, arXiv:2604.24005; see :mod:`.executors`).

Why hand-written: these are three-line functions of (step, total) whose *end points* matter (Guided-OPD's
claim is that guidance is withdrawn completely, so p(T) must be exactly 0, not 1e-3 as an exponential
scheduler from torch/transformers leaves it); pulling an LR-scheduler object in for them would add an
optimizer dependency and still need the end-point fix-up.

Every schedule is a frozen dataclass called with the global training step; past ``total_steps`` it
stays at its end value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

DecayKind = Literal["linear", "cosine", "exponential", "constant"]


def progress(step: int, total_steps: int) -> float:
    """``step / total_steps`` clipped to [0, 1]; a zero-length schedule is already finished."""
    if total_steps <= 0:
        return 1.0
    return min(max(step / total_steps, 0.0), 1.0)


def decay_factor(kind: DecayKind, x: float, rate: float = 5.0) -> float:
    """A factor that is exactly 1 at ``x = 0`` and exactly 0 at ``x = 1`` (``constant`` stays 1).

    ``exponential`` is ``exp(-rate x)`` shifted and rescaled so that it reaches 0 at the end instead of
    ``exp(-rate)``; ``rate`` sets how front-loaded the decay is.
    """
    if kind == "constant":
        return 1.0
    if kind == "linear":
        return 1.0 - x
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * x))
    if kind == "exponential":
        if rate <= 0:
            raise ValueError("exponential decay needs rate > 0 (e.g. 5.0)")
        return (math.exp(-rate * x) - math.exp(-rate)) / (1.0 - math.exp(-rate))
    raise ValueError(f"unknown decay kind {kind!r}; use linear, cosine, exponential or constant")


@dataclass(frozen=True)
class DecaySchedule:
    """``start`` at step 0 decaying to ``end`` at ``total_steps`` (Guided-OPD's teacher probability p(t))."""

    start: float
    total_steps: int
    kind: DecayKind = "linear"
    end: float = 0.0
    rate: float = 5.0

    def __call__(self, step: int) -> float:
        f = decay_factor(self.kind, progress(step, self.total_steps), self.rate)
        return self.end + (self.start - self.end) * f


@dataclass(frozen=True)
class DepthSchedule:
    """Exposed trajectory depth (in turns) growing from ``start`` to ``end`` over ``total_steps`` (TCOD).

    ``linear``: rounded linear interpolation. ``stages``: ``n_stages`` equal plateaus, the last one being
    ``end`` (the staged curriculum TCOD describes). Both return exactly ``start`` at step 0 and ``end``
    from ``total_steps`` on.
    """

    start: int
    end: int
    total_steps: int
    kind: Literal["linear", "stages"] = "linear"
    n_stages: int = 3

    def __post_init__(self) -> None:
        if self.start < 1 or self.end < self.start:
            raise ValueError(f"depth schedule needs 1 <= start <= end, got start={self.start} end={self.end}")

    def __call__(self, step: int) -> int:
        x = progress(step, self.total_steps)
        if self.kind == "linear":
            return int(round(self.start + (self.end - self.start) * x))
        if self.kind == "stages":
            if x >= 1.0:
                return self.end
            k = min(int(x * self.n_stages), self.n_stages - 1)  # 0 .. n-1
            frac = k / max(self.n_stages - 1, 1)
            return int(round(self.start + (self.end - self.start) * frac))
        raise ValueError(f"unknown depth schedule kind {self.kind!r}; use linear or stages")
