"""A failed stage prints a short block (stage, last meaningful lines, log, rerun), not tracebacks."""

from __future__ import annotations

import io
import logging
import pickle

from tasks.failures import StageFailed, StageNotRetryable, meaningful, quiet_prefect, stage_failed

TAIL = """Running stage 'sft-1':
> python -m apprentice sft --params params.yaml --root . --iter 1
Loading weights: 100%|██████████| 272/272 [00:00<00:00, 30955.95it/s]
[2026-12-04 20:03:04,170] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.
sft:  50%|█████     | 1/2 [00:35<00:35, 35.1s/it]\rsft: 100%|██████████| 2/2 [01:10<00:00, 35.1s/it]
/x/modeling_utils.py:3312: FutureWarning: `is_gradient_checkpointing` is deprecated
  warnings.warn(
error: sft.batch_size=4 needs 4 records, data/iter_1/sft.parquet has 0
fix: rerun validate, or lower sft.batch_size
ERROR: failed to reproduce 'sft-1': failed to run: python -m apprentice sft, exited with 1
"""


def test_the_block_keeps_what_went_wrong_and_drops_progress_and_chatter():
    assert meaningful(TAIL) == ["error: sft.batch_size=4 needs 4 records, data/iter_1/sft.parquet has 0",
                                "fix: rerun validate, or lower sft.batch_size"]
    e = StageFailed("sft-1", 1, TAIL, log="logs/sft-1.log", workdir="runs/quick",
                    rerun="dvc repro --single-item dvc.yaml:sft-1")
    block = str(e)
    assert block.splitlines()[0] == "stage sft-1 failed (exit 1)"
    assert "    error: sft.batch_size=4" in block and "%|" not in block and "Running stage" not in block
    assert "  full log:  logs/sft-1.log" in block
    assert "  rerun it:  cd runs/quick && dvc repro --single-item dvc.yaml:sft-1" in block
    assert len(block.splitlines()) <= 4 + 12
    assert repr(e) == "StageFailed('stage sft-1 failed (exit 1)')"  # what Prefect's one-liners show
    again = pickle.loads(pickle.dumps(e))  # Prefect stores the failed state's exception
    assert str(again) == block and again.retryable


def test_a_stage_that_says_not_retryable_is_not_retried():
    e = stage_failed("teacher-rollout-1", 1, "error: nothing listening at http://x [not retryable]\n")
    assert isinstance(e, StageNotRetryable) and not e.retryable
    assert "(not retried: a retry cannot fix it)" in str(e).splitlines()[0]
    assert str(StageFailed("x", 2, "")).splitlines()[1:] == ["  last lines:", "    (no output)"]


def test_prefect_run_loggers_lose_their_tracebacks():
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    logger = logging.getLogger("prefect.task_runs")
    logger.addHandler(handler)
    try:
        quiet_prefect()
        quiet_prefect()  # idempotent
        try:
            raise StageFailed("sft-1", 1, "error: boom\n")
        except StageFailed as e:
            logger.error("Task run failed with exception: %r", e, exc_info=True)
    finally:
        logger.removeHandler(handler)
    assert buf.getvalue() == "Task run failed with exception: StageFailed('stage sft-1 failed (exit 1)')\n"
