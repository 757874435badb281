"""The one place that knows where iteration k's artifacts live (dvc.yaml mirrors these paths)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

#: ``model.base`` values that prepare-base builds (relative to the root): the embedded SmolLM2 and the
#: quick profile's tiny random Llama. Any other ``model.base`` (an HF id, a user's folder) is only verified.
DEFAULT_BASE = "models/base"
TINY_BASE = "models/tiny"
BUILT_BASES = (DEFAULT_BASE, TINY_BASE)
#: DVCLive's folder inside a training stage's work dir, then inside its model folder (:mod:`apprentice.training.curves`).
DVCLIVE_DIR = "dvclive"


@dataclass(frozen=True)
class Paths:
    root: Path
    iteration: int = 1

    def rel(self, path: str | os.PathLike[str]) -> str:
        """``path`` relative to the root, in posix form, for the records a stage writes: a DVC-tracked
        output holding the clone's absolute path would hash differently in every folder."""
        p = Path(path)
        try:
            return p.resolve().relative_to(self.root.resolve()).as_posix() if p.is_absolute() else p.as_posix()
        except ValueError:
            return p.as_posix()  # outside the root (a user's model folder): only the path itself names it

    def stage_log(self, stage: str) -> Path:
        """A flow's full output of DVC stage ``stage`` (the failure block points here); git-ignored."""
        return self.root / "logs" / f"{stage}.log"

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
    def frontier_probe(self) -> Path:
        """The champion's episodes on the frontier controller's dev problems (empty in iteration 1)."""
        return self.data / "frontier.parquet"

    @property
    def frontier_record(self) -> Path:
        """The frontier controller's decision: probed cells with intervals, each family's window and mix."""
        return self.reports / "frontier.json"

    @property
    def synth_manifest(self) -> Path:
        """synth's resume manifest: the fingerprint its outputs are a function of (written last)."""
        return self.data / "synth.json"

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
    def benchmark_record(self) -> Path:
        """The benchmark stage's summary (problem counts per family and level; DVC metrics)."""
        return self.benchmark_dir / "benchmark.json"

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
    def train_data(self) -> Path:
        """What SFT trains on: the validated set mixed by the loop rule (``loop``)."""
        return self.data / "train.parquet"

    @property
    def champion_rollouts(self) -> Path:
        """The champion's episodes on this iteration's problems (loop rules ``self`` and ``repair``)."""
        return self.data / "champion.parquet"

    @property
    def loop_record(self) -> Path:
        """The loop-data stage's summary: rule, rows per source, learning rate (DVC metrics)."""
        return self.reports / "loop.json"

    @property
    def gate_record(self) -> Path:
        """The validate stage's summary; records whether the gate passed and the SFT set's SHA-256."""
        return self.reports / "gate.json"

    @property
    def gate_html(self) -> Path:
        """The validate stage's self-contained HTML report."""
        return self.reports / "gate.html"

    @property
    def evolve_dir(self) -> Path:
        """Environment evolution's generations (``gen_g.parquet``)."""
        return self.data / "evolve"

    def evolve_generation(self, g: int) -> Path:
        """Generation ``g`` of environment evolution (0 = the seed generation)."""
        return self.evolve_dir / f"gen_{g}.parquet"

    def evolve_generations(self) -> list[Path]:
        """The generations written so far, in order (``gen_0``, ``gen_1``, ...; not ``gen_10`` before ``gen_2``)."""
        return sorted(self.evolve_dir.glob("gen_*.parquet"), key=lambda f: int(f.stem.removeprefix("gen_")))

    @property
    def evolve_reference(self) -> Path:
        """The reference policy's episodes on every generation."""
        return self.evolve_dir / "reference.parquet"

    @property
    def evolve_record(self) -> Path:
        """Environment evolution's summary (DVC metrics)."""
        return self.data / "evolve.json"

    @property
    def eval_dir(self) -> Path:
        return self.data / "eval"

    # models
    @property
    def base_model(self) -> Path:
        return self.root / DEFAULT_BASE

    @property
    def sft_model(self) -> Path:
        return self.models / "sft"

    @property
    def rl_model(self) -> Path:
        return self.models / "rl"

    @property
    def student_model(self) -> Path:
        return self.models / "student"

    @property
    def student_record(self) -> Path:
        """How the student was made (its layers, parameter ratio, the teacher): inside its model folder."""
        return self.student_model / "student.json"

    def model_dir(self, policy: str) -> Path:
        """The folder of a model this iteration trains: ``sft``, ``rl`` or ``student``."""
        return {"sft": self.sft_model, "rl": self.rl_model, "student": self.student_model}[policy]

    @property
    def sft_start(self) -> Path:
        """Which model SFT started from (path + md5; DVC metrics)."""
        return self.reports / "sft_start.json"

    def eval_dir_for(self, policy: str) -> Path:
        """Where ``evaluate --policy policy`` writes: the base model once for all iterations, the rest per iteration."""
        return self.benchmark_eval_dir if policy == "base" else self.eval_dir

    def eval_episodes(self, policy: str) -> Path:
        """``evaluate --policy policy``'s per-episode rows on the benchmark."""
        return self.eval_dir_for(policy) / f"{policy}.parquet"

    def eval_metrics(self, policy: str) -> Path:
        """``evaluate --policy policy``'s metrics JSON (DVC metrics)."""
        return self.eval_dir_for(policy) / f"{policy}.json"

    def eval_outputs(self, policy: str) -> list[Path]:
        """The files ``evaluate --policy policy`` writes: per-episode rows and the metrics JSON."""
        return [self.eval_episodes(policy), self.eval_metrics(policy)]

    @property
    def promotion(self) -> Path:
        return self.reports / "promotion.json"

    def recorded_champion(self) -> tuple[str, Paths] | None:
        """(kind, iteration paths) of the champion this iteration's promotion record names; None without a
        readable one (stages that only prefer the champion read it here, not through the promote stage)."""
        import json

        try:
            champ = json.loads(self.promotion.read_text())["champion"]
            kind, iteration = str(champ["kind"]), int(champ["iteration"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return kind, self if kind == "base" else Paths(self.root, iteration)

    @property
    def curves_dir(self) -> Path:
        """The report stage's learning curves (CSV for DVC plots, PNG) and ``eval.md``."""
        return self.reports / "curves"

    @property
    def drift_record(self) -> Path:
        """Drift guards: the champion after each promotion 1..k, its per-family success and
        action diversity on the benchmark (flat numbers of iteration k become MLflow metrics)."""
        return self.reports / "drift.json"

    @property
    def report_page(self) -> Path:
        """The iteration's one-page report."""
        return self.reports / "index.html"

    @property
    def resources_log(self) -> Path:
        """Every stage's wall time and peak RSS, one JSON line per run (not a DVC output)."""
        return self.root / "reports" / "resources.jsonl"

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


def failures_file(output: Path) -> Path:
    """``<output>.failures.jsonl`` beside an episode table (and beside its shard folder): one JSON line
    per episode that failed after its retries (problem id, family, level, sample, last error), written
    by :func:`apprentice.rollout.shards.run_sharded` whenever a run leaves failures and removed when none are
    left. Not a DVC output: it describes a run, not the table."""
    return Path(output).with_suffix(".failures.jsonl")
