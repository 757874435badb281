"""Progress for long steps, and one switch to silence it: ``APPRENTICE_QUIET=1``.

Why a module for a flag: progress comes from three places (our ``tqdm`` bars, the HF Trainer's bar,
``run_episodes(progress=...)``), and tqdm's own ``TQDM_DISABLE`` only reaches bars created without
an explicit ``disable=``. Call sites ask :func:`enabled` instead of hard-coding ``True``, and
:func:`apply_quiet` (called by the CLI) sets ``TQDM_DISABLE`` for every other bar. CI logs (not a
TTY) get a bar line at most every ``TQDM_MININTERVAL`` seconds; quiet mode drops them entirely.

:class:`CheckpointProgress` is a ``TrainerCallback`` for the step no bar covers: saving a
checkpoint (seconds to minutes for a 135M model with optimizer state), with the training ETA.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from transformers import TrainerCallback

QUIET_ENV = "APPRENTICE_QUIET"


def quiet() -> bool:
    return os.environ.get(QUIET_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def enabled() -> bool:
    """Whether long steps should draw progress bars (off in quiet mode)."""
    return not quiet()


def apply_quiet() -> None:
    """In quiet mode, silence every tqdm bar that does not set ``disable`` itself (HF Trainer's too)."""
    if quiet():
        os.environ["TQDM_DISABLE"] = "1"


def _fmt(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


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
