"""Run episodes in shards that are flushed to disk as they finish, so a failure loses little.

Why: the teacher rollout and the evaluation used to write nothing until every episode was done. One
request that failed its retries (an endpoint that flaps) crashed the stage, threw away every finished
episode, and the rerun (or the Prefect retry) started from zero; a read-only output dir was found only
after all episodes had run.

Here the stage's problems are cut into shards of ``shard_size`` problems. Each shard runs through the
batched engine (``run_chunk``, e.g. ``apprentice.rollout.run_episodes`` on those rows) and is written
atomically to ``.<output>.shards-<fingerprint>/`` beside the output, so a rerun with the same inputs
loads the finished shards and runs only the others. A shard whose run raises is retried problem by
problem; a problem that still fails is recorded as a failed episode carrying its error
(``extra.error``, ``success=False``) and is *not* flushed, so the next rerun tries it again. The stage
fails only when the failed share passes ``error_budget`` (0 = any failure fails it, after every other
shard is saved). The output dir is checked writable before any episode runs.

The engine itself (``apprentice.rollout``) is untouched: this module only calls it on smaller tables.
Each shard seeds the engine with ``seed + shard index``, so shards are reproducible on their own.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from apprentice import codedeps
from apprentice.trajectories import Trajectory, trajectories_frame, write_parquet

if TYPE_CHECKING:
    from apprentice.config import Config, PolicyConfig

#: Parquet metadata key of an episode table's input fingerprint (:func:`fingerprint`).
FINGERPRINT_KEY = "apprentice_fingerprint"

#: Problems per shard: big enough that the engine still batches well, small enough that a crash costs little.
DEFAULT_SHARD_SIZE = 64


def model_fingerprint(ref: str) -> str:
    """Content hash of a local model folder's top-level files (weights, config, tokenizer), or the
    reference itself for a remote model. Hashing 0.5 GB takes ~1 s; far less than any rollout."""
    p = Path(ref)
    if not p.is_dir():
        return ref
    h = hashlib.sha256()
    for f in sorted(x for x in p.iterdir() if x.is_file() and not x.name.startswith(".")):
        h.update(f.name.encode())
        with f.open("rb") as fh:
            while block := fh.read(1 << 22):
                h.update(block)
    return h.hexdigest()


def fingerprint(problems: pd.DataFrame, pol_cfg: PolicyConfig, cfg: Config, stage_module: str,
                **settings: Any) -> str:
    """What an episode table of the stage ``stage_module`` depends on. It is stored in the table (a
    DVC output), so it holds no absolute path: a local model is named by its folder and identified
    by its content."""
    policy = pol_cfg.model_dump()
    if pol_cfg.kind == "hf" and Path(pol_cfg.model).is_dir():
        policy["model"] = Path(pol_cfg.model).name
    doc = {
        "specs": sorted(problems["spec"]),
        "policy": policy,
        "model": model_fingerprint(pol_cfg.model) if pol_cfg.kind == "hf" else "",
        "model_cfg": cfg.model.model_dump(exclude={"threads"}),
        "seed": cfg.pipeline.seed,
        # the code that plays the episodes (the stage, engine, policies, every environment) and library
        # versions: an edited environment must not leave a stale rollout behind (issue G)
        "code": codedeps.digest(stage_module),
        **settings,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def existing_if_complete(out: Path, fp: str, expected_rows: int) -> pd.DataFrame | None:
    """The output at ``out`` if it was written for exactly these inputs, else None."""
    if not out.exists():
        return None
    try:
        df = pd.read_parquet(out)
    except Exception:  # noqa: BLE001 - unreadable -> recompute
        return None
    if df.attrs.get(FINGERPRINT_KEY) != fp or len(df) != expected_rows:
        return None
    return df


class EpisodesFailed(RuntimeError):
    """More episodes failed than the error budget allows; finished ones are kept for the rerun."""


def check_writable(directory: Path) -> None:
    """Fail before any episode runs when ``directory`` cannot take the stage's outputs."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-probe-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise PermissionError(f"output dir {directory} is not writable ({e.strerror or e}); fix its permissions "
                              "or free disk space, or choose another --root/--out") from None


def shard_dir(target: Path, fingerprint: str, shard_size: int = DEFAULT_SHARD_SIZE) -> Path:
    """Where the shards of this output for these inputs live (another fingerprint never mixes in)."""
    target = Path(target)
    return target.parent / f".{target.stem}.shards-{fingerprint[:16]}-{shard_size}"


def failed_episode(row: pd.Series, sample_idx: int, policy_id: str, error: BaseException) -> Trajectory:
    return Trajectory(problem_id=str(row["problem_id"]), family=str(row.get("family", "")), spec=str(row.get("spec", "")),
                      difficulty=str(row.get("difficulty", "{}")), level=int(row.get("level", 0) or 0),
                      policy_id=policy_id, sample_idx=sample_idx, messages=[], tools=[], reward=0.0, success=False,
                      turns=0, truncated=False,
                      extra={"error": f"{type(error).__name__}: {' '.join(str(error).split())[:500]}"})


def run_sharded(problems: pd.DataFrame, run_chunk: Callable[[pd.DataFrame, int], list[Trajectory]], target: Path,
                fingerprint: str, *, samples: int, policy_id: str, shard_size: int = DEFAULT_SHARD_SIZE,
                error_budget: float = 0.0, seed: int = 0) -> tuple[pd.DataFrame, dict[str, Any]]:
    """All episodes of ``problems`` as one trajectory frame, resuming from flushed shards.

    ``run_chunk(rows, seed)`` runs ``samples`` episodes of each row. Returns the frame (ordered as the
    problems) and counts ``{"shards", "shards_reused", "failed"}``. Raises :class:`EpisodesFailed`
    past ``error_budget`` (a share of all episodes) after saving every shard that finished.
    """
    check_writable(Path(target).parent)
    sdir = shard_dir(target, fingerprint, shard_size)
    sdir.mkdir(parents=True, exist_ok=True)
    frames: list[pd.DataFrame] = []
    failed: list[Trajectory] = []
    reused = 0
    n = len(problems)
    starts = list(range(0, n, max(1, shard_size)))
    for i, start in enumerate(starts):
        rows = problems.iloc[start:start + shard_size]
        path = sdir / f"{i:05d}.parquet"
        done = _load(path, len(rows) * samples)
        if done is not None:
            frames.append(done)
            reused += 1
            continue
        if not any(sdir.glob(f"{i:05d}-*.parquet")):  # else it failed before: run only its missing problems
            try:
                df = trajectories_frame(run_chunk(rows, seed + i))
                write_parquet(df, path)
                frames.append(df)
                continue
            except Exception as e:  # noqa: BLE001 - isolate the failing problems, keep the others
                print(f"shard {i + 1}/{len(starts)} failed ({type(e).__name__}: {e}); retrying its problems one "
                      "by one", file=sys.stderr)
        for j in range(len(rows)):
            one = rows.iloc[j:j + 1]
            ppath = sdir / f"{i:05d}-{j:04d}.parquet"
            done = _load(ppath, samples)
            if done is None:
                try:
                    done = trajectories_frame(run_chunk(one, seed + i))
                    write_parquet(done, ppath)
                except Exception as e:  # noqa: BLE001 - recorded as failed episodes with their error
                    failed += [failed_episode(one.iloc[0], s, policy_id, e) for s in range(samples)]
                    continue
            frames.append(done)
    total = n * samples
    if failed and len(failed) > error_budget * total:
        first = failed[0].extra["error"]
        raise EpisodesFailed(
            f"{len(failed)} of {total} episodes failed after retries (error budget {error_budget:.0%}): first error "
            f"{first}; the {total - len(failed)} finished episodes are saved in {sdir} and a rerun runs only the "
            "failed ones (raise the error budget to accept failures)")
    if failed:
        frames.append(trajectories_frame(failed))
    out = pd.concat(frames, ignore_index=True) if frames else trajectories_frame([])
    order = {pid: k for k, pid in enumerate(problems["problem_id"].astype(str))}
    out = out.sort_values(["problem_id", "sample_idx"], key=lambda c: c.map(order) if c.name == "problem_id" else c,
                          kind="stable").reset_index(drop=True)
    return out, {"shards": len(starts), "shards_reused": reused, "failed": len(failed)}


def _load(path: Path, rows: int) -> pd.DataFrame | None:
    if not path.exists():
        return None
    try:
        df = pd.read_parquet(path)
    except Exception:  # noqa: BLE001 - a damaged shard is simply run again
        return None
    return df if len(df) == rows else None


def clear(target: Path, fingerprint: str, shard_size: int = DEFAULT_SHARD_SIZE) -> None:
    """Drop the shards once the complete output is written."""
    shutil.rmtree(shard_dir(target, fingerprint, shard_size), ignore_errors=True)


def failures(df: pd.DataFrame) -> list[str]:
    """The errors of failed episodes in a frame ``run_sharded`` returned."""
    errs = []
    for extra in df.get("extra", pd.Series(dtype=str)):
        with __import__("contextlib").suppress(TypeError, json.JSONDecodeError):
            if "error" in (e := json.loads(extra)):
                errs.append(e["error"])
    return errs


def without_wall_clock(df: pd.DataFrame) -> pd.DataFrame:
    """The frame as written to a DVC output: per-episode wall time zeroed (it differs on every run and
    would make two seeded runs' hashes differ); its total goes to a ``.timings.json`` beside the output."""
    if "wall_s" not in df.columns:
        return df
    out = df.copy()
    out["wall_s"] = 0.0
    out.attrs = dict(df.attrs)
    return out


def write_timings(target: Path, df: pd.DataFrame) -> None:
    """``<output>.timings.json``: wall-clock numbers of a run, beside the output but not part of it."""
    from apprentice.paths import atomic_path

    if "wall_s" not in df.columns or not float(df["wall_s"].sum()):
        return
    path = Path(target).with_suffix(".timings.json")
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps({"episodes": len(df), "total_wall_s": round(float(df["wall_s"].sum()), 3),
                                   "mean_wall_s": round(float(df["wall_s"].mean()), 4)}, indent=1) + "\n")
