"""Run episodes in shards that are flushed to disk as they finish, so a failure loses little.

Why: a stage that writes nothing until every episode is done loses them all to one request that
fails its retries (an endpoint that flaps), and its rerun (or the Prefect retry) starts from zero; a
read-only output dir would be found only after all episodes had run.

Here the stage's problems are cut into shards of ``shard_size`` problems. Each shard runs through the
batched engine (``run_chunk``, e.g. ``apprentice.rollout.episodes.run_episodes`` on those rows) as one batch and
its finished episodes are written atomically to ``.<output>.shards-<fingerprint>/`` beside the output,
so a rerun with the same inputs loads them and plays only what is missing. Failures are per episode:
the policy retries each request on its own, and a request that still fails ends only its episode, as
a failed episode carrying its error (``extra.error``, ``extra.failed``, ``success=False``); it is *not*
flushed, so the next rerun plays it again (in one batch with the shard's other missing episodes,
never a serial replay). Every failed episode is named, in the error and in
``<output>.failures.jsonl`` (:func:`apprentice.paths.failures_file`). The stage fails only when the
failed share passes ``error_budget`` (0 = any failure fails it, after every other shard is saved);
under it the failed rows stay in the output, marked (:func:`failed_mask`), for the gate to exclude.
An error that no problem can get past (``retryable = False``: a rejected key, an endpoint the circuit
breaker gave up on) stops the run at once, after saving what finished. The output dir is checked
writable before any episode runs.

Within a shard, each episode is also appended to the shard's journal (``<shard>.journal.jsonl``) the
moment it finishes (the engine's ``on_finish``): written and flushed per episode, so a SIGKILL loses
only the episodes still playing, and fsynced at most :data:`JOURNAL_SYNC_S` later, so a power cut loses
little more. A rerun folds the journal into the shard file before the shard runs and plays only the
episodes in neither; a journal whose first line names another fingerprint or shard is ignored, and a
last line cut short by the kill is dropped. ``run_chunk`` takes the callback as an ``on_finish``
keyword and the episodes it must not replay as ``skip`` (the engine's own keywords: a stage's
``run_chunk`` passes them through). A ``run_chunk`` that does not accept them is saved at shard
granularity and replays every sample of a problem with any sample missing; a Ray run journals its
episodes only when its actors hand them back, at the end of its run.

The fingerprint in the shard folder's name is what determines an episode (problems, model, sampling,
code), not how answers are fetched (URL, timeout, retries): a rerun with more retries resumes.
Each shard seeds the engine with ``seed + shard index``, so shards are reproducible on their own.

Which episodes a resumed run reproduces exactly: an episode's environment is built from its own
spec (``ProblemSpec.rng``), never from a shared RNG, and the rows a rerun plays are the missing
ones, seeded as their shard was. Deterministic policies (the oracle, a deterministic endpoint at
temperature 0) therefore give the same episodes, so the resumed table equals an uninterrupted run's
byte for byte; so does a local model's greedy decoding as far as its kernels give a row the same
logits whatever rows share its batch (left padding can change the rounding). A *sampling* local
model does not: it draws a whole batch's tokens from one generator
per ``act`` call (``seed`` + its call count), so an episode's tokens depend on which episodes shared
its batches and on the calls before; a resumed (or replayed) episode is a fresh sample from the same
policy, as a failed episode's replay always was.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from apprentice import codedeps
from apprentice.data.trajectories import TRAJECTORY_COLUMNS, Trajectory, trajectories_frame, write_parquet

if TYPE_CHECKING:
    from apprentice.config import Config, PolicyConfig

#: Parquet metadata key of an episode table's input fingerprint (:func:`fingerprint`).
FINGERPRINT_KEY = "apprentice_fingerprint"

#: Extra passes over a shard's failed episodes within the same run: a request that spent its retries
#: on an endpoint that fails now and then (every third request, say) is unlucky, not doomed, so its
#: episode is played once more, as one batch with the shard's other failures, before it counts as failed.
REPLAYS = 1

#: Problems per shard: big enough that the engine still batches well; a crash costs only the episodes
#: still playing (the journal keeps finished ones), a rerun replays them as one batch.
DEFAULT_SHARD_SIZE = 64

#: Longest a journaled episode waits for its fsync (episodes finishing close together share one).
JOURNAL_SYNC_S = 1.0

log = logging.getLogger(__name__)


def model_fingerprint(ref: str) -> str:
    """Content hash of a local model folder's top-level files (weights, config, tokenizer), or the
    reference itself for a remote model. Hashing the weights costs far less than any rollout."""
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
    """What an episode table of the stage ``stage_module`` depends on: what determines an episode
    (problems, model, sampling, chat template, the code that plays it, a plugin family's package
    version and source hash), not how the answers were fetched (``PolicyConfig.TRANSPORT``: URL, key
    variable, timeout, retries), so a rerun with more retries or on another port resumes the finished
    shards. It is stored in the table (a DVC output), so it holds no absolute path: a local model is
    named by its folder and identified by its content."""
    from apprentice import envs

    policy = pol_cfg.episode_settings()
    if pol_cfg.kind == "hf" and Path(pol_cfg.model).is_dir():
        policy["model"] = Path(pol_cfg.model).name
    doc = {
        "specs": sorted(problems["spec"]),
        "policy": policy,
        "model": model_fingerprint(pol_cfg.model) if pol_cfg.kind == "hf" else "",
        "model_cfg": cfg.model.model_dump(exclude={"threads"}),
        "seed": cfg.pipeline.seed,
        # the code that plays the episodes (the stage, engine, policies, every environment) and library
        # versions: an edited environment must not leave a stale rollout behind
        "code": codedeps.digest(stage_module),
        # a plugin family's code lives outside the project: its version and source hash
        "plugins": envs.plugin_sources(problems["family"] if "family" in problems.columns else []),
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


def failed_episode(row: pd.Series, sample_idx: int, policy_id: str, error: BaseException | str) -> Trajectory:
    """A failed episode of problem ``row``: reward 0, no messages, ``extra.error`` and ``extra.failed``."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return Trajectory(problem_id=str(row["problem_id"]), family=str(row.get("family", "")), spec=str(row.get("spec", "")),
                      difficulty=str(row.get("difficulty", "{}")), level=int(row.get("level", 0) or 0),
                      policy_id=policy_id, sample_idx=sample_idx, messages=[], tools=[], reward=0.0, success=False,
                      turns=0, truncated=False, extra={"error": " ".join(text.split())[:1000], "failed": True})


def _stops_everything(exc: BaseException) -> bool:
    """An error no other problem can get past (a rejected key, an endpoint that is down): the run
    stops at once instead of recording every remaining problem as failed."""
    return getattr(exc, "retryable", True) is False


def failed_mask(df: pd.DataFrame) -> pd.Series:
    """Per row of an episode table: True where the episode *failed* (the policy could not play it:
    an endpoint that failed after its retries), i.e. ``extra.failed`` / ``extra.error`` is set. Such
    rows are in a table only when ``error_budget`` accepted them; they say nothing about the policy
    and are what the data gate must exclude."""
    if "extra" not in df.columns:
        return pd.Series(False, index=df.index)
    return df["extra"].map(_row_failed).astype(bool)


def _row_failed(extra: Any) -> bool:
    try:
        e = json.loads(extra) if isinstance(extra, str) else (extra or {})
    except (TypeError, json.JSONDecodeError):
        return False
    return isinstance(e, dict) and bool(e.get("failed") or e.get("error"))


def _key(df: pd.DataFrame) -> set[tuple[str, int]]:
    return set(zip(df["problem_id"].astype(str), df["sample_idx"].astype(int), strict=True))


def run_sharded(problems: pd.DataFrame, run_chunk: Callable[..., list[Trajectory]], target: Path,
                fingerprint: str, *, samples: int, policy_id: str, shard_size: int = DEFAULT_SHARD_SIZE,
                error_budget: float = 0.0, seed: int = 0) -> tuple[pd.DataFrame, dict[str, Any]]:
    """All episodes of ``problems`` as one trajectory frame, resuming from flushed shards.

    ``run_chunk(rows, seed)`` runs ``samples`` episodes of each row. Each shard runs once, as one
    batch: its finished episodes are flushed (merged with those a previous run saved), its failed
    ones (``extra.error``) are not, so a rerun plays only those, again as one batch. When the engine
    raises, the episodes that had finished are still flushed; an error that stops everything
    (``retryable = False``: a rejected key, the circuit breaker) is re-raised at once, any other
    marks the shard's unfinished problems failed and the next shard runs.

    ``run_chunk`` may also take the engine's ``on_finish`` and ``skip`` keywords (or ``**kwargs``): it
    then gets the shard journal's callback, so a kill keeps every episode that had finished, and the
    episodes already saved, so a rerun plays only the rest, down to the sample (the module docstring
    says which policies reproduce them exactly).

    Returns the frame (ordered as the problems) and counts ``{"shards", "shards_reused", "failed"}``.
    Every failed episode is listed in :func:`apprentice.paths.failures_file` of ``target``. Raises
    :class:`EpisodesFailed`, naming every failed problem, past ``error_budget`` (a share of all
    episodes); under it, the failed rows stay in the frame, marked (:func:`failed_mask`).
    """
    from apprentice.paths import failures_file

    check_writable(Path(target).parent)
    sdir = shard_dir(target, fingerprint, shard_size)
    sdir.mkdir(parents=True, exist_ok=True)
    frames: list[pd.DataFrame] = []
    failed: list[Trajectory] = []
    reused = 0
    n = len(problems)
    starts = list(range(0, n, max(1, shard_size)))
    journals = _takes_resume_keywords(run_chunk)
    try:
        for i, start in enumerate(starts):
            rows = problems.iloc[start:start + shard_size]
            path = sdir / f"{i:05d}.parquet"
            jpath = journal_path(path)
            done = _load(path)
            have = _key(done) if done is not None else set()
            want = {(str(p), s) for p in rows["problem_id"] for s in range(samples)}
            missing = want - have
            kept = _unique([t for t in read_journal(jpath, fingerprint, i) if (t.problem_id, t.sample_idx) in missing])
            if kept:  # what a killed run had finished: into the shard file, then the journal can go
                done = _flush(path, done, kept)
                have |= {(t.problem_id, t.sample_idx) for t in kept}
            jpath.unlink(missing_ok=True)
            if want <= have:
                frames.append(done)
                reused += 1
                continue
            journal = _Journal(jpath, fingerprint, i, want - have) if journals else None
            try:
                done = _run_shard(run_chunk, rows, seed + i, samples, policy_id, path, done, have, failed, journal)
            finally:
                if journal is not None:
                    journal.close()
            jpath.unlink(missing_ok=True)  # every finished episode is in the shard file now
            if done is not None:
                frames.append(done)
    finally:
        _write_failures(failures_file(target), failed)

    total = n * samples
    if failed and len(failed) > error_budget * total:
        raise EpisodesFailed(
            f"{len(failed)} of {total} episodes failed after retries (error budget {error_budget:.0%}):\n"
            f"{describe_failures(failed)}\nevery failure is listed in {failures_file(target)}; the "
            f"{total - len(failed)} finished episodes are saved in {sdir} and a rerun plays only the failed ones "
            "(raise the error budget to accept failures)")
    if failed:
        print(f"accepted {len(failed)} failed of {total} episodes under the error budget ({error_budget:.0%}); "
              f"they are marked failed (extra.failed) in the output:\n{describe_failures(failed)}", file=sys.stderr)
        frames.append(trajectories_frame(failed))
    out = pd.concat(frames, ignore_index=True) if frames else trajectories_frame([])
    order = {pid: k for k, pid in enumerate(problems["problem_id"].astype(str))}
    out = out.sort_values(["problem_id", "sample_idx"], key=lambda c: c.map(order) if c.name == "problem_id" else c,
                          kind="stable").reset_index(drop=True)
    return out, {"shards": len(starts), "shards_reused": reused, "failed": len(failed)}


def _run_shard(run_chunk: Callable[..., list[Trajectory]], rows: pd.DataFrame, seed: int, samples: int,
               policy_id: str, path: Path, done: pd.DataFrame | None, have: set[tuple[str, int]],
               failed: list[Trajectory], journal: _Journal | None) -> pd.DataFrame | None:
    """Play the shard's missing episodes (one batch per pass, ``1 + REPLAYS`` passes over failures),
    flush the finished ones to ``path`` and add the failed ones to ``failed``; returns the shard's
    saved episodes. ``have`` grows with what is saved."""
    for attempt in range(1 + REPLAYS):
        todo = rows[[any((str(p), s) not in have for s in range(samples)) for p in rows["problem_id"]]]
        try:
            got = (run_chunk(todo, seed) if journal is None else
                   run_chunk(todo, seed, on_finish=journal.append, skip=frozenset(have)))
        except Exception as e:
            saved = [t for t in _finished_before(e) if (t.problem_id, t.sample_idx) not in have]
            if saved:  # what finished before the error is kept
                done = _flush(path, done, saved)
                have |= {(t.problem_id, t.sample_idx) for t in saved}
            if _stops_everything(e):
                raise
            got = [failed_episode(r, s, policy_id, e) for _, r in todo.iterrows() for s in range(samples)
                   if (str(r["problem_id"]), s) not in have]
        ok = [t for t in got if not t.extra.get("error") and (t.problem_id, t.sample_idx) not in have]
        lost = [t for t in got if t.extra.get("error") and (t.problem_id, t.sample_idx) not in have]
        if ok:
            done = _flush(path, done, ok)
            have |= {(t.problem_id, t.sample_idx) for t in ok}
        if not lost or attempt == REPLAYS:
            failed += lost
            break
    return done


def _takes_resume_keywords(fn: Callable[..., Any]) -> bool:
    """Whether ``run_chunk`` accepts the engine's ``on_finish`` and ``skip`` keywords."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return True
    return {"on_finish", "skip"} <= {p.name for p in params}


def _unique(trajs: list[Trajectory]) -> list[Trajectory]:
    """First of each (problem, sample): a journal never holds one twice, but a hand-edited one might."""
    seen: set[tuple[str, int]] = set()
    out = []
    for t in trajs:
        if (t.problem_id, t.sample_idx) not in seen:
            seen.add((t.problem_id, t.sample_idx))
            out.append(t)
    return out


def journal_path(shard: Path) -> Path:
    """The journal of the shard file ``shard`` (beside it, in the shard folder)."""
    return shard.with_name(shard.stem + ".journal.jsonl")


class _Journal:
    """Append-only record of a shard's finished episodes, one JSON line each (``Trajectory.to_row``),
    after a header line naming the fingerprint and shard. Each line is written and flushed as its
    episode finishes (a SIGKILL cannot take back what the kernel has); an fsync follows within
    :data:`JOURNAL_SYNC_S` (a timer thread), so episodes that finish in a burst share one. Failed
    episodes and episodes of other shards are not recorded: a rerun must play them. A journal that
    cannot be written (a full disk) is given up with a warning; the shard file still gets every
    finished episode when the shard's run returns."""

    def __init__(self, path: Path, fingerprint: str, shard: int, want: set[tuple[str, int]]) -> None:
        self.path, self.want = path, want
        self.header = json.dumps({"fingerprint": fingerprint, "shard": shard})
        self.fh: Any = None
        self.lock = threading.Lock()
        self.timer: threading.Timer | None = None
        self.synced = 0.0  # time.monotonic() of the last fsync
        self.dirty = self.broken = False

    def append(self, t: Trajectory) -> None:
        if self.broken or t.extra.get("error") or (t.problem_id, t.sample_idx) not in self.want:
            return
        line = json.dumps(t.to_row(), sort_keys=True) + "\n"  # ASCII: any text survives the round trip
        with self.lock:
            try:
                if self.fh is None:
                    self.fh = self.path.open("w", encoding="ascii")
                    self.fh.write(self.header + "\n")
                self.fh.write(line)
                self.fh.flush()
                self.dirty = True
                wait = self.synced + JOURNAL_SYNC_S - time.monotonic()
                if wait <= 0:
                    self._sync()
                elif self.timer is None:
                    self.timer = threading.Timer(wait, self._sync_later)
                    self.timer.daemon = True
                    self.timer.start()
            except OSError as e:
                self.broken = True
                log.warning("episode journal %s: %s; this shard's episodes are saved when it ends", self.path, e)

    def _sync(self) -> None:
        if self.dirty and self.fh is not None:
            os.fsync(self.fh.fileno())
        self.dirty, self.synced = False, time.monotonic()

    def _sync_later(self) -> None:
        with self.lock:
            self.timer = None
            if self.fh is not None and not self.fh.closed:
                with contextlib.suppress(OSError):  # the shard file gets these episodes when the shard ends
                    self._sync()

    def close(self) -> None:
        with self.lock:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            if self.fh is not None:
                with contextlib.suppress(OSError):
                    self._sync()
                with contextlib.suppress(OSError):
                    self.fh.close()


def read_journal(path: Path, fingerprint: str, shard: int) -> list[Trajectory]:
    """The finished episodes a killed run journaled for shard ``shard`` of these inputs, in finish
    order: none when there is no journal or its header names another fingerprint or shard; a line the
    kill cut short (no newline, not JSON) is dropped."""
    try:
        lines = path.read_bytes().split(b"\n")[:-1]  # whatever follows the last newline is a cut-off write
    except OSError:
        return []
    try:
        head = json.loads(lines[0].decode("ascii")) if lines else None
    except ValueError:  # JSONDecodeError and UnicodeDecodeError both are
        return []
    if not isinstance(head, dict) or head.get("fingerprint") != fingerprint or head.get("shard") != shard:
        return []
    out = []
    for line in lines[1:]:
        try:
            out.append(_from_row(json.loads(line.decode("ascii"))))
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
    return out


def _from_row(row: dict[str, Any]) -> Trajectory:
    """The Trajectory whose ``to_row()`` is ``row`` (the JSON columns decoded)."""
    fields = {k: row[k] for k in TRAJECTORY_COLUMNS}
    for k in ("messages", "tools", "extra"):
        fields[k] = json.loads(fields[k])
    return Trajectory(**fields)


#: failed problems named one per line in an error message; the rest are counted (all are in the file)
MAX_NAMED = 50


def describe_failures(failed: list[Trajectory]) -> str:
    """One line per failed problem: id, family, level, how many of its samples failed, its last error."""
    by_problem: dict[str, list[Trajectory]] = {}
    for t in failed:
        by_problem.setdefault(t.problem_id, []).append(t)
    lines = []
    for pid, ts in list(by_problem.items())[:MAX_NAMED]:
        t = ts[-1]
        samples = f", {len(ts)} samples" if len(ts) > 1 else ""
        lines.append(f"  problem {pid} (family {t.family}, level {t.level}{samples}): {t.extra.get('error')}")
    if len(by_problem) > MAX_NAMED:
        lines.append(f"  ... and {len(by_problem) - MAX_NAMED} more problems")
    return "\n".join(lines)


def _write_failures(path: Path, failed: list[Trajectory]) -> None:
    from apprentice.paths import atomic_path

    if not failed:
        path.unlink(missing_ok=True)
        return
    with atomic_path(path) as tmp:
        tmp.write_text("".join(json.dumps({"problem_id": t.problem_id, "family": t.family, "level": t.level,
                                           "sample_idx": t.sample_idx, "error": t.extra.get("error")}) + "\n"
                               for t in failed))


def _finished_before(exc: BaseException) -> list[Trajectory]:
    from apprentice.rollout.episodes import finished_before

    return finished_before(exc)


def _flush(path: Path, done: pd.DataFrame | None, new: list[Trajectory]) -> pd.DataFrame:
    """The shard's saved episodes plus ``new``, written atomically; returns the merged frame."""
    merged = trajectories_frame(new) if done is None else pd.concat([done, trajectories_frame(new)], ignore_index=True)
    write_parquet(merged, path)
    return merged


def _load(path: Path) -> pd.DataFrame | None:
    """The finished episodes a previous run flushed to ``path`` (None if none or unreadable)."""
    if not path.exists():
        return None
    try:
        df = pd.read_parquet(path)
    except Exception:  # noqa: BLE001 - a damaged shard is simply run again
        return None
    return df if len(df) else None


def clear(target: Path, fingerprint: str, shard_size: int = DEFAULT_SHARD_SIZE) -> None:
    """Drop the shards once the complete output is written."""
    shutil.rmtree(shard_dir(target, fingerprint, shard_size), ignore_errors=True)


def failures(df: pd.DataFrame) -> list[str]:
    """The errors of failed episodes in a frame ``run_sharded`` returned."""
    errs = []
    for extra in df.loc[failed_mask(df), "extra"]:
        errs.append(str(json.loads(extra).get("error", "")))
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
