"""Stage ``validate``: the data gate between teacher rollout and training.

Runs the Great Expectations suites (``expectations/``) on the problems, the evaluation problems,
the teacher trajectories and the SFT set derived from them; writes ``reports/iter_k/gate.html``
(self-contained) and ``gate.json`` (DVC metrics) whether or not the gate passes (an input table that
cannot be read, a 0-byte one included, is a failed gate with its report), and writes the SFT
set (success-only when ``validate.success_only``) only when every suite passes. On a violation it
raises :class:`apprentice.gate.GateFailed`, so the CLI exits non-zero, ``dvc repro`` stops and
nothing downstream runs.

What "trusted" means here: every teacher episode is replayed in a fresh environment (a
recorded success that the calls do not earn, or an observation the environment would not give,
fails the gate naming the problem); problems are unique by *content* (normalised task text +
oracle plan, :mod:`apprentice.data.dedupe`) within training and against the held-out set, not only by
id; the SFT set has zero tolerance for malformed turns, invalid calls, error observations and
over-long messages, and every episode it leaves out is counted and listed with its reason in the
report. A missing column fails the gate naming it; it never crashes the stage.

The audit (:func:`apprentice.gate.audit_episode`, the checks in
:data:`apprentice.gate.EPISODE_CHECKS`) walks every episode in a fresh environment, and
each rejection names the episode (``<problem id>/sample <k>``) and the check, in the CLI output and in
``gate.html``. Which checks fail the gate and which only exclude is decided by one question: can an
honest rollout record it?

* **fail the gate** (the transcript contradicts the environment or the config; no rollout the engine
  ran writes it): a spec the environment does not accept (unknown family, an ``Infinity`` seed, an
  axis out of range: a named failure, never an exception); a system prompt, task text or format
  feedback the environment does not render; a broken call/result protocol; an observation or success
  the replay does not give; a reward that is not the replayed one or disagrees with success; a
  ``sample_idx`` past ``rollout.samples_per_problem`` or a second copy of an episode; a family the
  config does not allow (``synth.families`` plus registered plugin families, never "whatever the data
  holds"); a task text equal to a held-out one once case, whitespace and punctuation are dropped;
  rollout failures past ``rollout.error_budget``.
* **exclude from the SFT set, gate passes** (an honest teacher can produce it; training must not):
  not a success, truncated, malformed turns, invalid calls, over-long messages; control characters,
  ANSI escapes, NUL, lone surrogates or mojibake in any message; the chat template's control tokens or
  tool-call / tool-result markup inside any message (derived from the configured tokenizer and
  template, :mod:`apprentice.gate.protocol`); call arguments stored as a JSON string instead of an
  object; an argument of any call using a secret of the problem no earlier observation showed
  (:mod:`apprentice.gate.secrets`, plus ``Environment.ungrounded``); an assistant turn stating a
  secret value, a run of the oracle's route or the oracle plan before it was shown; a call of the
  terminal turn left without a result; an over-long assistant message; and rows the rollout marked
  failed under ``rollout.error_budget``.

The previous ``sft.parquet`` is removed before anything is checked (as ``dvc repro`` does), so a
failed gate in the plain CLI leaves no SFT set behind; ``gate.json`` records the SHA-256 of the
set it passed, and ``sft``/``distill`` refuse data without that record
(:func:`apprentice.gate.require_passed`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from apprentice import gate
from apprentice.config import Config
from apprentice.data.trajectories import read_parquet, write_parquet
from apprentice.paths import Paths


def _rel(path: Path, paths: Paths) -> str:
    try:
        return str(Path(path).relative_to(paths.root))
    except ValueError:
        return str(path)


def _ids(df: pd.DataFrame) -> list[str]:
    return sorted(df["problem_id"].dropna().astype(str).unique()) if "problem_id" in df.columns else []


def allowed_families(names: list[str]) -> list[str]:
    """The families the config allows: ``names`` (``synth.families`` or the benchmark's), each through
    the environment registry, plus every family a plugin registered (``envs.modules``, or an installed
    package's ``apprentice.envs`` entry point). Not the families the data happens to hold: a row of a
    built-in family the config does not train on fails the gate by name."""
    from apprentice.envs import FAMILIES, load_entry_points, resolve

    allowed = {resolve(f).family for f in names}
    load_entry_points()
    allowed |= {name for name, cls in FAMILIES.items() if not cls.__module__.startswith("apprentice.")}
    return sorted(allowed)


def _task_keys(df: pd.DataFrame) -> list[str]:
    """Normalised task texts of a held-out table's buildable problems (contamination by wording)."""
    from apprentice.data.dedupe import spec_task_key
    from apprentice.envs.base import ProblemSpec

    out = []
    for s in df["spec"] if "spec" in df.columns else []:
        if gate.spec_problem(s):
            continue
        try:
            out.append(spec_task_key(ProblemSpec.from_json(str(s))))
        except Exception:  # noqa: BLE001 - the problems suite reports a spec that does not build
            continue
    return out


def _content_keys(df: pd.DataFrame) -> list[str]:
    """Content keys of a held-out table's buildable problems (unbuildable ones fail their own suite)."""
    from apprentice.data.dedupe import content_key

    out = []
    for s in df["spec"] if "spec" in df.columns else []:
        if gate.spec_problem(s):
            continue
        try:
            out.append(content_key(str(s)))
        except Exception:  # noqa: BLE001 - the problems suite reports a spec that does not build
            continue
    return out


def select_sft(teacher: pd.DataFrame, success_only: bool, max_message_chars: int) -> tuple[pd.DataFrame, list[dict[str, Any]]]:
    """The SFT set and the excluded episodes (``problem_id``, ``sample_idx``, ``check``, ``effect``,
    ``reason``: :func:`apprentice.gate.episode_rejections`), in row order."""
    per_row = gate.row_rejections(teacher, success_only, max_message_chars)
    keep = [r is None for r in per_row]
    sft = teacher[keep].reset_index(drop=True) if len(teacher) else teacher.copy()
    return sft, [r for r in per_row if r is not None]


def _unreadable(path: Path, paths: Paths, suite: str, error: BaseException) -> gate.GateResult:
    """A failed result for an input table that cannot be read (missing, 0 bytes, not Parquet)."""
    what = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
    return gate.GateResult(suite, _rel(path, paths), 0, [gate.Check(
        "table_is_readable_parquet", {"path": _rel(path, paths)}, False, what)])


def _read_inputs(paths: Paths) -> list[pd.DataFrame]:
    """The three input tables; an unreadable one fails the gate with its report written (the stage
    promises a report whether or not the gate passes, and a 0-byte file is a failed gate, not a crash)."""
    frames, bad = [], []
    for path, suite in ((paths.problems, "problems"), (paths.eval_problems, "problems"),
                        (paths.teacher_trajectories, "trajectories")):
        try:
            frames.append(read_parquet(path))
        except Exception as e:  # noqa: BLE001 - any reader error (pyarrow, OSError) is the same finding
            bad.append(_unreadable(path, paths, suite, e))
    if bad:
        gate.write_reports(bad, paths.gate_html, paths.gate_record, f"Data gate, iteration {paths.iteration}")
        print("\n".join(r.summary() for r in bad))
        gate.raise_if_failed(bad, paths.gate_html)
    return frames


def _protocol_markers(cfg: Config, paths: Paths) -> tuple[str, ...]:
    """The control tokens and tool markup of the tokenizer and chat template the SFT set is rendered
    with (``model.base``, ``model.chat_template``): no message content may hold them."""
    from apprentice.gate import protocol

    base = Path(cfg.model.base)
    base = base if base.is_absolute() else paths.root / base
    return protocol.markers_for(str(base) if base.is_dir() else "", cfg.model.chat_template)


def _crashed(error: BaseException, teacher: pd.DataFrame, paths: Paths, excluded: list[dict[str, Any]]) -> None:
    """A gate that cannot run on this data still leaves a (failed) report naming why."""
    what = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
    result = gate.GateResult("gate", _rel(paths.teacher_trajectories, paths), len(teacher),
                             [gate.Check("gate_runs", {}, False, what)])
    gate.write_reports([result], paths.gate_html, paths.gate_record, f"Data gate, iteration {paths.iteration}",
                       excluded=excluded)


def run(cfg: Config, paths: Paths, **_: Any) -> dict[str, Any]:
    v = cfg.validate_
    # No SFT set survives a gate run that does not pass (the plain CLI as safe as `dvc repro`).
    paths.sft_data.unlink(missing_ok=True)
    problems, eval_problems, teacher = _read_inputs(paths)
    gate.use_protocol(_protocol_markers(cfg, paths))
    held_out = [eval_problems]  # every held-out set (the benchmark) goes here: training must not repeat it
    eval_ids = sorted({i for df in held_out for i in _ids(df)})
    held_content = sorted({k for df in held_out for k in _content_keys(df)})
    train_families = allowed_families(cfg.synth.families)
    eval_families = allowed_families(cfg.benchmark_families)
    held_tasks = sorted({k for df in held_out for k in _task_keys(df)})

    html_path, json_path = paths.gate_html, paths.gate_record
    excluded: list[dict[str, Any]] = []
    try:
        sft, excluded = select_sft(teacher, v.success_only, v.max_message_chars)
    except Exception as err:
        _crashed(err, teacher, paths, excluded)
        raise
    # Training data carries no wall-clock timings: a re-run teacher rollout with the same episodes then
    # yields a byte-identical SFT set, and DVC does not retrain SFT for nothing.
    sft = sft.drop(columns=["wall_s"], errors="ignore")

    checks = [
        ("problems", problems, _rel(paths.problems, paths),
         {"splits": ["train"], "forbidden_ids": eval_ids, "forbidden_content": held_content,
          "forbidden_tasks": held_tasks, "families": train_families}),
        ("problems", eval_problems, _rel(paths.eval_problems, paths),
         {"splits": ["eval", "test"], "forbidden_ids": [], "forbidden_content": [], "forbidden_tasks": [],
          "families": eval_families}),
        ("trajectories", teacher, _rel(paths.teacher_trajectories, paths),
         {"max_truncation_rate": v.max_truncation_rate, "min_success_rate": v.min_success_rate,
          "eval_problem_ids": eval_ids, "train_problem_ids": _ids(problems), "families": train_families,
          "max_message_chars": v.max_message_chars, "error_budget": cfg.rollout.error_budget,
          "max_sample_idx": cfg.rollout.samples_per_problem - 1, "forbidden_tasks": held_tasks}),
        ("sft_data", sft, f"sft set (from {_rel(paths.teacher_trajectories, paths)})",
         {"allowed_success": [True] if v.success_only else [True, False], "eval_problem_ids": eval_ids,
          "max_message_chars": v.max_message_chars}),
    ]
    try:
        results = [gate.check(df, suite, params, table=name)
                   for suite, df, name, params in tqdm(checks, desc="validate", unit="suite")]
    except Exception as err:
        _crashed(err, teacher, paths, excluded)
        raise
    passed = all(r.success for r in results)
    if passed:
        write_parquet(sft, paths.sft_data)
    gate.write_reports(results, html_path, json_path, f"Data gate, iteration {paths.iteration}",
                        excluded=excluded, sft_path=paths.sft_data if passed else None)
    print("\n".join(r.summary() for r in results))
    if excluded:
        counts = ", ".join(f"{k}: {n}" for k, n in gate.reason_counts(excluded).items())
        print(f"{len(excluded)} of {len(teacher)} teacher episodes excluded from the SFT set ({counts}); "
              f"each is listed in {html_path}:")
        for e in excluded:  # every rejection by name: the episode, the check, what it does to the gate
            print(f"  {gate.episode_name(e['problem_id'], e['sample_idx'])} [{e['check']}, {e['effect']}] "
                  f"{str(e['reason'])[:240]}")
    gate.raise_if_failed(results, html_path)
    return {"passed": True, "problems": len(problems), "eval_problems": len(eval_problems),
            "teacher_rows": len(teacher), "sft_rows": len(sft), "sft_excluded": len(excluded),
            "sft_excluded_by_reason": gate.reason_counts(excluded),
            "teacher_success_rate": float(teacher["success"].mean()),
            "truncation_rate": float(teacher["truncated"].mean()),
            "report": str(html_path)}


def sft_rows(teacher: pd.DataFrame, success_only: bool,
             max_message_chars: int | None = None) -> tuple[pd.DataFrame, dict[str, int]]:
    """The SFT set and how many teacher rows each reason excluded (what the iteration report shows)."""
    from collections import Counter

    from apprentice.config import ValidateConfig

    limit = ValidateConfig().max_message_chars if max_message_chars is None else max_message_chars
    sft, excluded = select_sft(teacher, success_only, limit)
    return sft, dict(Counter(str(e["reason"]) for e in excluded))
