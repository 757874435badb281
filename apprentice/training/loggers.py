"""Callbacks every trainer gets besides ``common.MetricsCallback``: one registration point.

The trainers call ``[common.MetricsCallback(...), *loggers.callbacks(stage), *callbacks]``, so a
logger added here reaches SFT, GRPO and distillation without touching the three trainers again.
Today: :class:`CheckpointProgress` (saving a checkpoint says so, with its
duration and the training ETA: the HF bar stands still while it saves).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from transformers import TrainerCallback

from apprentice.progress import _fmt


def callbacks(stage: str) -> list[Any]:
    return [CheckpointProgress(stage)]


class CheckpointProgress(TrainerCallback):
    """Say when a checkpoint starts saving, how long it took, and the training ETA (one line each)."""

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self.t_save: float | None = None
        self.t_train = time.time()

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001 (HF signature)
        self.t_train = time.time()

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
        if control.should_save and state.is_world_process_zero:
            self.t_save = time.time()
            self._say(f"{self.stage}: saving checkpoint-{state.global_step} ...")

    def on_save(self, args, state, control, **kwargs):  # noqa: ANN001
        if self.t_save is None or not state.is_world_process_zero:
            return
        took = time.time() - self.t_save
        self.t_save = None
        done, total = state.global_step, state.max_steps or 0
        eta = ""
        if total and 0 < done < total:
            per = (time.time() - self.t_train) / done
            eta = f"; {done}/{total} steps, ETA {_fmt(per * (total - done))}"
        self._say(f"{self.stage}: checkpoint-{done} saved in {took:.1f} s{eta}")

    @staticmethod
    def _say(msg: str, file: Any = None) -> None:
        print(msg, file=file or sys.stderr, flush=True)  # one line each, quiet mode included
