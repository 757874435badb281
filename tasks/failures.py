"""What a failed stage prints: a short block, not two Prefect tracebacks.

A stage runs as a DVC subprocess, so the Python traceback Prefect logs for the task (and again for
the flow) is the orchestration's, not the stage's: dozens of lines that bury the one line that says what
went wrong. So a failed stage raises :class:`StageFailed` whose ``str`` is a block with the stage,
its last meaningful output lines, the full log file and the command that reruns it, and whose
``repr`` (what Prefect's "failed with exception: %r" lines show) is one line. :func:`quiet_prefect`
drops the tracebacks from Prefect's run loggers; ``--debug`` or ``APPRENTICE_DEBUG=1`` keeps them.
"""

from __future__ import annotations

import logging
import os
import re

from apprentice import pipeline as registry

#: lines of a stage's output that are progress or tool chatter, not what went wrong
_NOISE = re.compile(
    r"^\s*$|\d+%\||it/s\]|s/it\]|ep/s|step/s|^Loading weights|^Writing model shards|^Running stage|^> |"
    r"^To track the changes|^\s*git add|^To enable auto staging|^\s*dvc config core\.autostage|"
    r"^Use `dvc push`|^Updating lock file|^Stage '.*' didn't change|real_accelerator\.py|FutureWarning|"
    r"UserWarning|^\s*warnings\.warn\(|^\s*super\(\)\.__init__|^ERROR: failed to reproduce")
MEANINGFUL_LINES = 12


def meaningful(output: str, n: int = MEANINGFUL_LINES) -> list[str]:
    """The last ``n`` lines of ``output`` that are neither progress bars nor DVC/library chatter."""
    lines = [ln.rstrip() for chunk in output.splitlines() for ln in chunk.split("\r")[-1:]]
    return [ln for ln in lines if not _NOISE.search(ln)][-n:]


class StageFailed(RuntimeError):
    """A DVC stage exited non-zero; ``str`` is the block to print, ``repr`` one line."""

    retryable = True

    def __init__(self, name: str, rc: int, output: str, log: str = "", workdir: str = "", rerun: str = ""):
        self.name, self.rc, self.output, self.log, self.workdir, self.rerun = name, rc, output, log, workdir, rerun
        super().__init__(self.block())

    @property
    def headline(self) -> str:
        why = " (not retried: a retry cannot fix it)" if not self.retryable else ""
        return f"stage {self.name} failed (exit {self.rc}){why}"

    def block(self) -> str:
        lines = [self.headline, "  last lines:"]
        lines += [f"    {ln}" for ln in meaningful(self.output)] or ["    (no output)"]
        if self.log:
            lines.append(f"  full log:  {self.log}")
        if self.rerun:
            lines.append(f"  rerun it:  {f'cd {self.workdir} && ' if self.workdir else ''}{self.rerun}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.headline!r})"

    def __reduce__(self):  # Prefect pickles task results: keep every field
        return (type(self), (self.name, self.rc, self.output, self.log, self.workdir, self.rerun))


class StageNotRetryable(StageFailed):
    """The stage's own error says a retry cannot fix it (its CLI printed
    :data:`apprentice.pipeline.NOT_RETRYABLE`: a rejected key, nothing listening): not retried."""

    retryable = False


def stage_failed(name: str, rc: int, output: str, **where: str) -> StageFailed:
    """The exception for a failed stage: :class:`StageNotRetryable` when its own error says so."""
    cls = StageNotRetryable if registry.NOT_RETRYABLE in output else StageFailed
    return cls(name, rc, output, **where)


def debug_requested(argv_debug: bool = False) -> bool:
    return argv_debug or os.environ.get("APPRENTICE_DEBUG", "").lower() in ("1", "true", "yes")


class _NoTracebacks(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and record.exc_info:
            record.exc_info, record.exc_text = None, None
        return True


def quiet_prefect() -> None:
    """Drop the tracebacks Prefect's task/flow run loggers attach to failures (the block says it all)."""
    for name in ("prefect.task_runs", "prefect.flow_runs", "prefect.engine", "prefect.task_engine",
                 "prefect.flow_engine"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTracebacks) for f in logger.filters):
            logger.addFilter(_NoTracebacks())
