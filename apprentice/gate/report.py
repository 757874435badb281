"""The gate's report: a self-contained HTML page and a JSON record; the record gates training.

:func:`write_reports` writes both; :func:`require_passed` is what a training stage calls before it
reads the SFT set (the record must name that file's SHA-256); :func:`raise_if_failed` turns failed
suites into :class:`~apprentice.gate.results.GateFailed`. The page is self-contained because GX Data
Docs load bootstrap, jquery and font-awesome from CDNs and lose their pass/fail icons offline.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from apprentice.gate.results import GateFailed, GateResult, _short, episode_name
from apprentice.paths import atomic_path

_CSS = """body{font:14px system-ui,sans-serif;margin:2em;color:#222}h1{font-size:20px}
h2{font-size:16px;margin-top:1.6em}table{border-collapse:collapse;width:100%}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3}.PASS{color:#fff;background:#2e7d32;font-weight:bold}
.FAIL{color:#fff;background:#c62828;font-weight:bold}code{font-size:12px;word-break:break-all}"""


def render_html(results: Sequence[GateResult], title: str, excluded: Sequence[Mapping[str, Any]] = ()) -> str:
    """A single self-contained page (inline CSS, no scripts, no external resources)."""
    ok = all(r.success for r in results)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}: "
             f"<span class='{'PASS' if ok else 'FAIL'}'>&nbsp;{'PASSED' if ok else 'FAILED'}&nbsp;</span></h1>"]
    for r in results:
        n_ok = sum(c.success for c in r.checks)
        parts.append(f"<h2>{html.escape(r.suite)} on <code>{html.escape(r.table)}</code> ({r.rows} rows): "
                     f"{n_ok}/{len(r.checks)} passed</h2><table><tr><th>status</th><th>expectation</th>"
                     "<th>arguments</th><th>observed</th><th>bad rows (examples)</th><th>episodes / problem ids</th></tr>")
        for c in sorted(r.checks, key=lambda c: c.success):
            status = "PASS" if c.success else "FAIL"
            bad = "" if not c.unexpected_count else f"{c.unexpected_count}: {_short(c.examples, 300)}"
            parts.append(f"<tr><td class='{status}'>{status}</td><td>{html.escape(c.expectation)}</td>"
                         f"<td><code>{html.escape(_short(c.kwargs, 400))}</code></td>"
                         f"<td><code>{html.escape('' if c.observed is None else _short(c.observed))}</code></td>"
                         f"<td><code>{html.escape(bad)}</code></td>"
                         f"<td><code>{html.escape(', '.join(c.episodes or c.problem_ids))}</code></td></tr>")
        parts.append("</table>")
    if excluded:
        counts = reason_counts(excluded)
        n_fail = sum(e.get("effect") == "fails the gate" for e in excluded)
        parts.append(f"<h2>Episodes excluded from the SFT set: {len(excluded)}</h2><p>"
                     + (f"{n_fail} of them fail the gate (the transcript contradicts the environment or the "
                        "config); the others are excluded and the gate still passes. " if n_fail else "")
                     + "; ".join(f"{html.escape(k)}: {v}" for k, v in counts.items())
                     + "</p><table><tr><th>episode (problem id / sample)</th><th>check</th><th>effect</th>"
                     "<th>reason</th></tr>")
        parts.extend(f"<tr><td><code>{html.escape(episode_name(e.get('problem_id'), e.get('sample_idx')))}</code></td>"
                     f"<td>{html.escape(str(e.get('check', '')))}</td>"
                     f"<td class='{'FAIL' if e.get('effect') == 'fails the gate' else ''}'>"
                     f"{html.escape(str(e.get('effect', 'excluded')))}</td>"
                     f"<td>{html.escape(str(e.get('reason')))}</td></tr>"
                     for e in excluded)
        parts.append("</table>")
    parts.append("</body></html>")
    return "\n".join(parts)


def reason_counts(excluded: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Excluded episodes per reason kind (the text before the first ':')."""
    counts: dict[str, int] = {}
    for e in excluded:
        kind = str(e.get("reason", "")).split(":")[0]
        counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def write_reports(results: Sequence[GateResult], html_path: Path, json_path: Path, title: str,
                  excluded: Sequence[Mapping[str, Any]] = (), sft_path: Path | None = None) -> None:
    """Write the HTML page and a JSON summary (DVC metrics) atomically.

    ``excluded`` lists the episodes kept out of the SFT set, each with its reason. ``sft_path`` (only
    when the gate passed and the SFT set is written) records that file's SHA-256: the gate record
    :func:`require_passed` checks before anything trains on it."""
    passed = all(r.success for r in results)
    with atomic_path(Path(html_path)) as tmp:
        tmp.write_text(render_html(results, title, excluded))
    summary = {"passed": passed,
               "expectations": sum(len(r.checks) for r in results),
               "failed": sum(len(r.failed) for r in results),
               "sft_excluded": len(excluded),
               "sft_excluded_by_reason": reason_counts(excluded),
               "suites": {f"{r.suite}:{r.table}": r.to_dict() for r in results},
               "excluded_episodes": list(excluded)}
    if passed and sft_path is not None:
        summary["sft_sha256"] = _file_sha256(Path(sft_path))
    with atomic_path(Path(json_path)) as tmp:
        tmp.write_text(json.dumps(summary, indent=1, default=str))


def _file_sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def require_passed(data_path: Path, record_path: Path) -> None:
    """Raise :class:`GateFailed` unless ``record_path`` (``gate.json``) records a passed gate for exactly
    the bytes of ``data_path`` (the SFT set): training never reads data the gate did not pass."""
    data_path, record_path = Path(data_path), Path(record_path)
    fix = "run `python -m apprentice validate` and fix what its report lists"
    if not record_path.exists():
        raise GateFailed(f"{data_path} has no gate record ({record_path} is missing); {fix}")
    try:
        record = json.loads(record_path.read_text())
    except json.JSONDecodeError as e:
        raise GateFailed(f"gate record {record_path} is unreadable ({e}); {fix}") from None
    if record.get("passed") is not True:
        raise GateFailed(f"the data gate FAILED ({record_path}, {record.get('failed')} failed expectations): "
                         f"{data_path} is not trained on; {fix}")
    if not data_path.exists():
        raise FileNotFoundError(f"{data_path} does not exist; {fix}")
    if record.get("sft_sha256") != _file_sha256(data_path):
        raise GateFailed(f"{data_path} is not the file the gate passed (SHA-256 differs from {record_path}); "
                         f"it was changed after validation; {fix}")


def raise_if_failed(results: Sequence[GateResult], report: Path | None = None) -> None:
    failed = [r for r in results if not r.success]
    if failed:
        where = f"\nfull report: {report}" if report else ""
        raise GateFailed("data gate failed; nothing downstream runs until the data is fixed:\n"
                         + "\n".join(r.summary() for r in failed) + where, results)
