"""Callbacks every trainer gets besides ``common.MetricsCallback``: one registration point.

The trainers call ``[logged, *loggers.callbacks(stage, logged), *callbacks]`` (``logged``: their
``common.MetricsCallback``), so a logger added here reaches SFT, GRPO and distillation without
touching the three trainers again:

* :class:`CheckpointProgress`: saving a checkpoint says so, with its duration and the training ETA
  (the HF bar stands still while it saves).
* :class:`DVCLiveLogger`: the training curves, through transformers' own ``DVCLiveCallback``, into
  ``<work>/dvclive`` (``metrics.json`` summary + ``plots/metrics/<name>.tsv`` per metric), which
  ``common.finalize`` moves into the model folder. ``dvc.yaml`` declares those files as the
  pipeline's plots and metrics (``apprentice.ops.dvcgen``), so ``dvc plots show/diff`` and
  ``dvc exp show`` read them as they are, and ``apprentice.ops.lineage`` logs the same files to MLflow
  as step metrics: no converter of our own in between.

Why a subclass and not ``report_to="dvclive"``: the rows it logs are ``MetricsCallback``'s (a resumed
run continues TRL's ``num_tokens`` and the summary ``train_loss`` instead of restarting them, at the
checkpoint's ``global_step``, not a private step counter), without wall-clock fields (the model
folder is a DVC output: two seeded runs must write the same bytes), and without DVCLive's repository
side effects: ``Live.end()`` ``git add``s/``dvc add``s its folder under
``dvc exp run``, and ``Live()`` *initialises DVC* in an enclosing Git repo that has none. Under
``dvc repro`` DVCLive's documented pipeline mode applies (``save_dvc_exp=False``, ``dvcyaml=None``:
the pipeline's ``dvc.yaml`` declares the files); ``_stage_live`` also skips its repository probe, so
it writes its folder and nothing else (no experiment, no commit, no ``.dvc``; only, inside a DVC
repo, the VS Code extension's step signal under the DVC-ignored ``.dvc/tmp``, cleared at the end). ``report_to``
stays ``"none"`` (``common.trl_args``): with dvclive installed, ``"all"`` would add the stock callback,
which writes ``./dvclive`` and saves a DVC experiment at the end.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.integrations import DVCLiveCallback

from apprentice.paths import DVCLIVE_DIR
from apprentice.progress import _fmt
from apprentice.training.common import is_wall_clock
from apprentice.training.curves import trim_dvclive

#: Row fields that are not metrics, or vary run to run (those go to ``.timings`` and MLflow only).
_NOT_LOGGED = ("stage", "step")


def callbacks(stage: str, metrics: Any = None) -> list[Any]:
    """The loggers every trainer registers; ``metrics`` (the stage's ``common.MetricsCallback``) adds
    DVCLive, writing beside the metrics file."""
    out: list[Any] = [CheckpointProgress(stage)]
    if metrics is not None:
        out.append(DVCLiveLogger(Path(metrics.path).parent / DVCLIVE_DIR, metrics))
    return out


def _stage_live(directory: Path, resume: bool) -> Any:
    from dvclive import Live

    class _StageLive(Live):
        """``Live`` that only writes its files (DVCLive is pinned exactly; tests/unit/test_dvclive.py
        checks this override: no ``.dvc`` appears in a Git repo, nothing is committed)."""

        def _init_dvc(self) -> None:
            # Live._init_dvc opens (or *creates*) a DVC repo around the cwd to save experiments and
            # post to Studio; a pipeline stage does neither. Keep its pipeline detection only.
            self._inside_dvc_pipeline = bool(os.getenv("DVC_ROOT"))
            self._save_dvc_exp = False

    return _StageLive(str(directory), resume=resume, save_dvc_exp=False, dvcyaml=None, report=None)


class DVCLiveLogger(DVCLiveCallback):
    """transformers' ``DVCLiveCallback`` fed ``MetricsCallback``'s rows at their ``global_step``.

    A fresh run starts an empty folder; a resumed one (the metrics file has rows up to the
    checkpoint's step) cuts the plot files to that step and appends after it, so the curves continue.
    """

    def __init__(self, directory: Path, metrics: Any) -> None:
        super().__init__(live=None, log_model=False)
        self.directory = Path(directory)
        self.metrics = metrics

    def setup(self, args, state, model):  # noqa: ANN001 (HF signature)
        # not the parent's: it logs TrainingArguments as params (paths, run names); params.yaml has them
        self._initialized = True
        if state.is_world_process_zero and self.live is None:
            resume = self.metrics.last_step > 0
            if resume:
                trim_dvclive(self.directory, self.metrics.last_step)
            self.live = _stage_live(self.directory, resume)

    def on_log(self, args, state, control, model=None, logs=None, **kwargs):  # noqa: ANN001
        row = self.metrics.last_row
        if not logs or not row or row.get("step") != state.global_step or not state.is_world_process_zero:
            return
        if not self._initialized:
            self.setup(args, state, model)
        assert self.live is not None  # setup made it (world process zero)
        self.live.step = int(row["step"])
        super().on_log(args, state, control, model=model,
                       logs={k: v for k, v in row.items() if k not in _NOT_LOGGED and not is_wall_clock(k)}, **kwargs)

    def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001
        # not Live.end(): under `dvc exp run` it git-adds / dvc-adds the folder and saves an experiment
        if self._initialized and self.live is not None:
            from dvclive.vscode import cleanup_dvclive_step_completed

            self.live.step = int(self.metrics.last_row.get("step", state.global_step))  # next_step ran past it
            self.live.make_summary()
            cleanup_dvclive_step_completed()  # what Live.end() clears: the VS Code extension's step signal


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
