"""Progress for long steps, and one switch to silence it: ``APPRENTICE_QUIET=1``.

Why a module for a flag: progress comes from three places (our ``tqdm`` bars, the HF Trainer's bar,
``run_episodes(progress=...)``), and tqdm's own ``TQDM_DISABLE`` only reaches bars created without
an explicit ``disable=``. Call sites ask :func:`enabled` instead of hard-coding ``True``, and
:func:`apply_quiet` (called by the CLI) sets ``TQDM_DISABLE`` for every other bar. CI logs (not a
TTY) get a bar line at most every ``TQDM_MININTERVAL`` seconds; quiet mode drops them entirely.

:class:`apprentice.training.loggers.CheckpointProgress` covers the step no bar covers (saving a
checkpoint). It lives there, not here, so that this module stays free of ``transformers``: every
stage's CLI imports it, and importing ``transformers`` costs seconds per process (a synth or
report stage would spend most of its time on it).
"""

from __future__ import annotations

import os

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
