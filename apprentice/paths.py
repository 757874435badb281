"""The one place that knows where iteration k's artifacts live (dvc.yaml mirrors these paths)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Paths:
    root: Path
    iteration: int = 1

    @property
    def data(self) -> Path:
        return self.root / "data" / f"iter_{self.iteration}"

    @property
    def models(self) -> Path:
        return self.root / "models" / f"iter_{self.iteration}"

    @property
    def reports(self) -> Path:
        return self.root / "reports" / f"iter_{self.iteration}"

    # data
    @property
    def problems(self) -> Path:
        return self.data / "problems.parquet"

    @property
    def benchmark_dir(self) -> Path:
        """The fixed benchmark: synthesized once, the same in every iteration (not under ``iter_k``)."""
        return self.root / "data" / "benchmark"

    @property
    def benchmark(self) -> Path:
        return self.benchmark_dir / "problems.parquet"

    @property
    def benchmark_eval_dir(self) -> Path:
        """Evaluations that belong to no iteration: the base model's, scored once on the benchmark."""
        return self.benchmark_dir / "eval"

    @property
    def eval_problems(self) -> Path:
        """The held-out problems every model of every iteration is scored on: the fixed benchmark."""
        return self.benchmark

    @property
    def teacher_trajectories(self) -> Path:
        return self.data / "teacher.parquet"

    @property
    def sft_data(self) -> Path:
        return self.data / "sft.parquet"

    @property
    def gate_record(self) -> Path:
        """The validate stage's summary; records whether the gate passed and the SFT set's SHA-256."""
        return self.reports / "gate.json"

    @property
    def eval_dir(self) -> Path:
        return self.data / "eval"

    # models
    @property
    def base_model(self) -> Path:
        return self.root / "models" / "base"

    @property
    def sft_model(self) -> Path:
        return self.models / "sft"

    @property
    def rl_model(self) -> Path:
        return self.models / "rl"

    @property
    def student_model(self) -> Path:
        return self.models / "student"

    def eval_dir_for(self, policy: str) -> Path:
        """Where ``evaluate --policy policy`` writes: the base model once for all iterations, the rest per iteration."""
        return self.benchmark_eval_dir if policy == "base" else self.eval_dir

    @property
    def promotion(self) -> Path:
        return self.reports / "promotion.json"

    def previous(self) -> Paths | None:
        return Paths(self.root, self.iteration - 1) if self.iteration > 1 else None


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temp path beside ``final``; rename it onto ``final`` only if the block succeeds.

    Works for files and directories. A crash leaves the previous ``final`` (or nothing) in place,
    never a half-written output; stale temps are named ``.<name>.tmp-*`` and ignored by readers.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent)) / final.name
    try:
        yield tmp
        if final.is_dir() and not final.is_symlink():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)


def eval_jsons(eval_dir: Path) -> list[Path]:
    """The ``<policy>.json`` metrics of an evaluation folder, sorted (not the ``.timings.json`` beside them)."""
    return sorted(f for f in eval_dir.glob("*.json") if not f.name.endswith(".timings.json"))
