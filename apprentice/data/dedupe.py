"""Content-level identity of problems: normalised task text + oracle plan.

Why not the ``problem_id``: it hashes the *spec* (family, seed, difficulty), so two specs with
different seeds that build the same episode (a small grid drawn twice, a question with the same
answer path) get different ids. A held-out problem copied into training under a new id, or the
same task repeated within training, then passes every id-level check while it leaks the evaluation
or over-weights one episode. Two problems are the *same content* when a fresh environment shows the
agent the same task (whitespace and case normalised) and the privileged oracle solves it with the
same tool calls: the model cannot tell them apart, so neither can the gate.

Used by synthesis (never emit a content duplicate) and the validate gate (train vs held-out sets,
and within training); the benchmark set reuses :func:`find_content_duplicates` the same way.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from apprentice.envs.base import ProblemSpec

_WS = re.compile(r"\s+")


def normalise_text(text: str) -> str:
    """Case-folded, whitespace-collapsed text (what a reader would call "the same words")."""
    return _WS.sub(" ", str(text)).strip().casefold()


_NOT_WORD = re.compile(r"[\W_]+")


def task_key(text: str) -> str:
    """The task text reduced to its words: Unicode NFKC, case-folded, every run of punctuation and
    whitespace one space. A benchmark task copied into training with its case, spacing or
    punctuation changed has the same key (the gate's contamination check)."""
    import unicodedata

    return _NOT_WORD.sub(" ", unicodedata.normalize("NFKC", str(text)).casefold()).strip()


def spec_task_key(spec: ProblemSpec) -> str:
    """:func:`task_key` of the task a fresh environment renders for ``spec``."""
    from apprentice.envs import resolve

    return task_key(resolve(spec.family)().reset(spec=spec))


def spec_content_key(spec: ProblemSpec) -> str:
    """SHA-256 (16 hex) of the normalised task text and the oracle plan of a freshly reset episode."""
    from apprentice.envs import resolve

    env = resolve(spec.family)()
    task = env.reset(spec=spec)  # the first observation: the task the agent sees
    plan = [[c.name, dict(sorted(dict(c.arguments).items()))] for c in env.oracle()]
    blob = json.dumps({"family": spec.family, "task": normalise_text(task), "plan": plan},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def content_key(problem_row: Mapping[str, Any] | ProblemSpec | str) -> str:
    """The content key of a problem: a problems-table row (its ``spec`` column), a spec or spec JSON."""
    if isinstance(problem_row, ProblemSpec):
        return spec_content_key(problem_row)
    if isinstance(problem_row, str):
        return spec_content_key(ProblemSpec.from_json(problem_row))
    return spec_content_key(ProblemSpec.from_json(problem_row["spec"]))


def _rows(table: Any) -> list[tuple[str, str]]:
    """(problem_id, spec JSON) pairs of a problems DataFrame, a list of rows or a list of specs."""
    if hasattr(table, "columns"):  # a DataFrame
        return [(str(p), str(s)) for p, s in zip(table["problem_id"], table["spec"], strict=True)]
    out = []
    for r in table:
        if isinstance(r, ProblemSpec):
            out.append((r.problem_id, r.to_json()))
        else:
            out.append((str(r["problem_id"]), str(r["spec"])))
    return out


def find_content_duplicates(table: Any, against: Iterable[Any] = (),
                            keys: dict[str, str] | None = None) -> dict[str, list[str]]:
    """Problem ids of ``table`` that duplicate content, each mapped to the ids it duplicates.

    A row is a duplicate when its content key equals that of an earlier row of ``table`` (within
    the set: the first occurrence is kept, later ones are reported) or of any row of a table in
    ``against`` (the held-out or benchmark sets). ``keys`` caches spec JSON -> key across calls.
    Tables are problems DataFrames, lists of rows with ``problem_id``/``spec``, or lists of specs.
    """
    cache = keys if keys is not None else {}

    def key(spec_json: str) -> str:
        if spec_json not in cache:
            cache[spec_json] = content_key(spec_json)
        return cache[spec_json]

    reference: dict[str, list[str]] = {}
    for other in against:
        for pid, spec in _rows(other):
            reference.setdefault(key(spec), []).append(pid)
    seen: dict[str, str] = {}
    dups: dict[str, list[str]] = {}
    for pid, spec in _rows(table):
        k = key(spec)
        hits = list(reference.get(k, []))
        if k in seen:
            hits.insert(0, seen[k])
        else:
            seen[k] = pid
        if hits:
            dups[pid] = hits
    return dups


def content_keys(specs: Sequence[ProblemSpec]) -> list[str]:
    return [spec_content_key(s) for s in specs]
