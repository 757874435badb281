"""Callbacks every trainer gets besides ``common.MetricsCallback``: one registration point.

The trainers call ``[common.MetricsCallback(...), *loggers.callbacks(stage), *callbacks]``, so a
logger added here reaches SFT, GRPO and distillation without touching the three trainers again.
Today: :class:`apprentice.progress.CheckpointProgress` (saving a checkpoint says so, with its
duration and the training ETA: the HF bar stands still while it saves).
"""

from __future__ import annotations

from typing import Any

from apprentice.progress import CheckpointProgress


def callbacks(stage: str) -> list[Any]:
    return [CheckpointProgress(stage)]
