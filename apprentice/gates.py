"""Data gates: Great Expectations suites from ``expectations/*.json`` run on pandas frames.

The only module that imports ``great_expectations`` (imported lazily: it costs ~3 s, and only the
validate and promote stages need it).

Design choices (measured, see shared/design/OPS-STACK-NOTES.md §6):

* An **ephemeral** GX context plus our own JSON loader: the suite files in ``expectations/`` are
  the single source of truth (GX's own ``to_json_dict`` format, ids stripped), nothing else on
  disk, identical in tests and production.
* Thresholds that come from params (truncation rate, success rate, the evaluation problem ids)
  are GX **suite parameters** (``{"$PARAMETER": "max_truncation_rate"}``) filled per run.
* Checks GX cannot express cheaply are **derived boolean columns** declared in the suite's
  ``meta.derived_columns`` and computed here: JSON-schema validity of the messages with a
  precompiled validator (GX's native JSON-schema expectation takes 8.6 s per 10k rows and errors
  out on one unparsable row), tool calls that name a declared tool with arguments matching its
  schema, and difficulty vectors inside their environment's axes. The suite then asserts
  ``column in [True]`` so the report counts and lists the offending rows like any expectation.
* The report is a small **self-contained HTML** page written here: GX Data Docs load bootstrap,
  jquery and font-awesome from CDNs and lose their pass/fail icons offline.
"""

from __future__ import annotations

import functools
import html
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from apprentice.paths import atomic_path

SUITES_DIR = Path(__file__).resolve().parent.parent / "expectations"


class GateFailed(ValueError):
    """A gate found violations; ``str(e)`` lists every failed expectation (the CLI prints it)."""

    def __init__(self, message: str, results: Sequence[GateResult] = ()):
        super().__init__(message)
        self.results = list(results)


@dataclass
class Check:
    """One expectation's outcome, flattened for printing, the HTML report and MLflow."""

    expectation: str
    kwargs: dict[str, Any]
    success: bool
    observed: Any = None
    unexpected_count: int | None = None
    examples: list[Any] = field(default_factory=list)

    def line(self) -> str:
        what = ", ".join(f"{k}={_short(v)}" for k, v in self.kwargs.items())
        bits = []
        if self.observed is not None:
            bits.append(f"observed {_short(self.observed)}")
        if self.unexpected_count:
            bits.append(f"{self.unexpected_count} bad rows, e.g. {_short(self.examples)}")
        status = "PASS" if self.success else "FAIL"
        return f"  {status} {self.expectation}({what})" + (f" -> {'; '.join(bits)}" if bits else "")


@dataclass
class GateResult:
    suite: str
    table: str
    rows: int
    checks: list[Check]

    @property
    def success(self) -> bool:
        return all(c.success for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.success]

    def summary(self) -> str:
        n_ok = sum(c.success for c in self.checks)
        head = (f"gate '{self.suite}' on {self.table} ({self.rows} rows): "
                f"{'passed' if self.success else 'FAILED'} ({n_ok}/{len(self.checks)} expectations)")
        return "\n".join([head, *(c.line() for c in self.failed)])

    def to_dict(self) -> dict[str, Any]:
        return {"suite": self.suite, "table": self.table, "rows": self.rows, "success": self.success,
                "checks": [c.__dict__ for c in self.checks]}


def _short(v: Any, n: int = 160) -> str:
    s = json.dumps(v, default=str) if not isinstance(v, str) else v
    return s if len(s) <= n else s[: n - 3] + "..."


# ---- derived columns ---------------------------------------------------------------------------

def _loads(s: Any) -> Any:
    return json.loads(s) if isinstance(s, str) else s


@functools.lru_cache(maxsize=256)
def _validator(schema_json: str) -> Any:
    import jsonschema

    schema = json.loads(schema_json)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema)


def _json_schema_ok(series: pd.Series, schema: Mapping[str, Any], row: pd.DataFrame) -> pd.Series:
    v = _validator(json.dumps(schema, sort_keys=True))

    def ok(s: Any) -> bool:
        try:
            return bool(v.is_valid(_loads(s)))
        except (ValueError, TypeError):
            return False

    return series.map(ok)


@functools.lru_cache(maxsize=64)
def _tool_validators(tools_json: str) -> dict[str, Any]:
    out = {}
    for t in json.loads(tools_json):
        fn = t.get("function", t)
        out[fn["name"]] = _validator(json.dumps(fn.get("parameters") or {"type": "object"}, sort_keys=True))
    return out


def _tool_calls_ok(series: pd.Series, spec: Mapping[str, Any], df: pd.DataFrame) -> pd.Series:
    """Every assistant tool call names a tool in the row's ``tools`` and its arguments fit its schema."""
    tools_col = spec.get("tools_from", "tools")

    def ok(messages: Any, tools: Any) -> bool:
        try:
            validators = _tool_validators(tools if isinstance(tools, str) else json.dumps(tools))
            for m in _loads(messages):
                for call in m.get("tool_calls") or []:
                    fn = call.get("function", call)
                    args = _loads(fn.get("arguments", {}))
                    v = validators.get(fn.get("name"))
                    if v is None or not isinstance(args, dict) or not v.is_valid(args):
                        return False
            return True
        except (ValueError, TypeError, KeyError, AttributeError):
            return False

    return pd.Series([ok(m, t) for m, t in zip(series, df[tools_col], strict=True)], index=series.index)


def _difficulty_ok(series: pd.Series, spec: Mapping[str, Any], df: pd.DataFrame) -> pd.Series:
    """The difficulty vector has exactly the family's axes, each inside [low, high]."""
    from apprentice.envs import FAMILIES

    def ok(diff: Any, family: Any) -> bool:
        env = FAMILIES.get(family)
        try:
            d = _loads(diff)
        except ValueError:
            return False
        if env is None or not isinstance(d, dict) or set(d) != {ax.name for ax in env.axes}:
            return False
        return all(ax.low <= int(d[ax.name]) <= ax.high for ax in env.axes)

    return pd.Series([ok(d, f) for d, f in zip(series, df[spec.get("family_from", "family")], strict=True)],
                     index=series.index)


def tool_calls_valid(df: pd.DataFrame) -> pd.Series:
    """Per-row: every tool call is well-formed (used to filter the SFT set)."""
    if df.empty:
        return pd.Series([], dtype=bool, index=df.index)
    return _tool_calls_ok(df["messages"], {}, df).astype(bool)


DERIVED: dict[str, Callable[[pd.Series, Mapping[str, Any], pd.DataFrame], pd.Series]] = {
    "json_schema": lambda s, spec, df: _json_schema_ok(s, spec["json_schema"], df),
    "tool_calls": _tool_calls_ok,
    "difficulty": _difficulty_ok,
}


def add_derived(df: pd.DataFrame, meta: Mapping[str, Any]) -> pd.DataFrame:
    out = df.copy()
    for col, spec in meta.get("derived_columns", {}).items():
        src = spec["from"]
        if src not in out.columns:  # the schema expectation reports the missing column
            out[col] = False
            continue
        out[col] = DERIVED[spec["check"]](out[src], spec, out).astype(bool)
    return out


# ---- GX ----------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _batch_definition() -> Any:
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    ctx = gx.get_context(mode="ephemeral")
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
    asset = ctx.data_sources.add_pandas("frames").add_dataframe_asset("frame")
    return ctx, asset.add_batch_definition_whole_dataframe("whole")


def load_suite(name: str, suites_dir: Path = SUITES_DIR) -> dict[str, Any]:
    path = Path(suites_dir) / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"expectation suite {path} not found; suites: "
                                f"{sorted(p.stem for p in Path(suites_dir).glob('*.json'))}")
    return json.loads(path.read_text())


def check(df: pd.DataFrame, suite: str, params: Mapping[str, Any] | None = None, table: str = "",
          suites_dir: Path = SUITES_DIR) -> GateResult:
    """Validate ``df`` against suite ``suite`` (``expectations/<suite>.json``); never raises on violations."""
    import great_expectations as gx

    spec = load_suite(suite, suites_dir)
    ctx, batch_def = _batch_definition()
    if spec["name"] in {s.name for s in ctx.suites.all()}:
        ctx.suites.delete(spec["name"])  # the file is the source of truth, reload every call
    gx_suite = ctx.suites.add(gx.ExpectationSuite(name=spec["name"], expectations=spec["expectations"],
                                                  meta=spec.get("meta", {})))
    frame = add_derived(df, spec.get("meta", {}))
    result = batch_def.get_batch(batch_parameters={"dataframe": frame}).validate(
        gx_suite, expectation_parameters=dict(params or {}),
        result_format={"result_format": "SUMMARY", "partial_unexpected_count": 5})
    res = json.loads(json.dumps(result.to_json_dict(), default=str))  # numpy scalars -> plain JSON
    checks = []
    for r in res["results"]:
        cfg, out = r["expectation_config"], r.get("result") or {}
        kwargs = {k: v for k, v in cfg["kwargs"].items() if k != "batch_id"}
        if isinstance(kwargs.get("value_set"), list) and len(kwargs["value_set"]) > 8:
            kwargs["value_set"] = f"<{len(kwargs['value_set'])} values>"
        checks.append(Check(cfg["type"], kwargs, bool(r["success"]), out.get("observed_value"),
                            out.get("unexpected_count"), out.get("partial_unexpected_list") or []))
        if r.get("exception_info", {}).get("raised_exception"):
            checks[-1].observed = r["exception_info"].get("exception_message")
    return GateResult(spec["name"], table or suite, len(df), checks)


# ---- reports -----------------------------------------------------------------------------------

_CSS = """body{font:14px system-ui,sans-serif;margin:2em;color:#222}h1{font-size:20px}
h2{font-size:16px;margin-top:1.6em}table{border-collapse:collapse;width:100%}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3}.PASS{color:#fff;background:#2e7d32;font-weight:bold}
.FAIL{color:#fff;background:#c62828;font-weight:bold}code{font-size:12px;word-break:break-all}"""


def render_html(results: Sequence[GateResult], title: str) -> str:
    """A single self-contained page (inline CSS, no scripts, no external resources)."""
    ok = all(r.success for r in results)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}: "
             f"<span class='{'PASS' if ok else 'FAIL'}'>&nbsp;{'PASSED' if ok else 'FAILED'}&nbsp;</span></h1>"]
    for r in results:
        n_ok = sum(c.success for c in r.checks)
        parts.append(f"<h2>{html.escape(r.suite)} on <code>{html.escape(r.table)}</code> ({r.rows} rows): "
                     f"{n_ok}/{len(r.checks)} passed</h2><table><tr><th>status</th><th>expectation</th>"
                     "<th>arguments</th><th>observed</th><th>bad rows (examples)</th></tr>")
        for c in sorted(r.checks, key=lambda c: c.success):
            status = "PASS" if c.success else "FAIL"
            bad = "" if not c.unexpected_count else f"{c.unexpected_count}: {_short(c.examples, 300)}"
            parts.append(f"<tr><td class='{status}'>{status}</td><td>{html.escape(c.expectation)}</td>"
                         f"<td><code>{html.escape(_short(c.kwargs, 400))}</code></td>"
                         f"<td><code>{html.escape('' if c.observed is None else _short(c.observed))}</code></td>"
                         f"<td><code>{html.escape(bad)}</code></td></tr>")
        parts.append("</table>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_reports(results: Sequence[GateResult], html_path: Path, json_path: Path, title: str) -> None:
    """Write the HTML page and a JSON summary (DVC metrics) atomically."""
    with atomic_path(Path(html_path)) as tmp:
        tmp.write_text(render_html(results, title))
    summary = {"passed": all(r.success for r in results),
               "expectations": sum(len(r.checks) for r in results),
               "failed": sum(len(r.failed) for r in results),
               "suites": {f"{r.suite}:{r.table}": r.to_dict() for r in results}}
    with atomic_path(Path(json_path)) as tmp:
        tmp.write_text(json.dumps(summary, indent=1, default=str))


def raise_if_failed(results: Sequence[GateResult], report: Path | None = None) -> None:
    failed = [r for r in results if not r.success]
    if failed:
        where = f"\nfull report: {report}" if report else ""
        raise GateFailed("data gate failed; nothing downstream runs until the data is fixed:\n"
                         + "\n".join(r.summary() for r in failed) + where, results)
