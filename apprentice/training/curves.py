"""Training curves on disk: DVCLive's folder of every training stage, read without DVCLive.

A training stage logs through DVCLive (``apprentice.training.loggers``) into ``<model>/dvclive``:
``metrics.json`` (the last value of each metric, DVC's *metrics*) and ``plots/metrics/<name>.tsv``
(``step`` and the value, one row per logging step, DVC's *plots*). DVC reads those files itself
(``dvc plots show/diff``, ``dvc exp show``); this module is the one reader for the rest of the project
(MLflow step metrics in ``apprentice.ops.lineage``, the report's charts), kept free of DVCLive,
transformers and torch so those readers stay light.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

# DVCLive's folder inside a training stage's model folder: named in paths.py, re-exported for curve readers
from apprentice.paths import DVCLIVE_DIR as DVCLIVE_DIR


def dvclive_tsvs(directory: Path) -> dict[str, Path]:
    """DVCLive's per-metric plot files: metric name (``train/loss``) -> ``plots/metrics/train/loss.tsv``."""
    root = Path(directory) / "plots" / "metrics"
    return {p.relative_to(root).with_suffix("").as_posix(): p for p in sorted(root.rglob("*.tsv"))}


def read_dvclive(directory: Path) -> list[dict[str, Any]]:
    """DVCLive's plot files as rows ``{"step": s, name: value, ...}``, one per step, in step order."""
    by_step: dict[int, dict[str, Any]] = {}
    for name, path in dvclive_tsvs(directory).items():
        with path.open(newline="") as f:
            for rec in csv.DictReader(f, delimiter="\t"):
                try:
                    step, value = int(rec["step"]), float(rec[path.stem])
                except (KeyError, TypeError, ValueError):
                    continue  # a line a kill cut short
                by_step.setdefault(step, {"step": step})[name] = value
    return [by_step[s] for s in sorted(by_step)]


def trim_dvclive(directory: Path, upto_step: int) -> None:
    """Drop the plot rows logged after ``upto_step`` (steps a killed run logged after its last
    checkpoint, which the resumed run logs again); the same cut as ``common.trim_metrics``."""
    for path in dvclive_tsvs(directory).values():
        lines = path.read_text().splitlines(keepends=True)
        keep = lines[:1] + [ln for ln in lines[1:] if ln.endswith(("\n", "\r"))
                            and ln.split("\t", 1)[0].strip().isdigit() and int(ln.split("\t", 1)[0]) <= upto_step]
        if keep != lines:
            tmp = path.with_suffix(".tsv.tmp")
            tmp.write_text("".join(keep))
            os.replace(tmp, path)


def summary(directory: Path) -> dict[str, Any]:
    """DVCLive's ``metrics.json`` (``{}`` when absent)."""
    f = Path(directory) / "metrics.json"
    return json.loads(f.read_text()) if f.exists() else {}
