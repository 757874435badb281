"""The Great Expectations glue: the only module that imports ``great_expectations``.

An ephemeral GX context plus our own JSON loader: the suite files in ``expectations/`` are the
single source of truth (GX's own ``to_json_dict`` format, ids stripped), identical in tests and
production. Thresholds that come from params are GX suite parameters
(``{"$PARAMETER": "max_truncation_rate"}``) filled per run. GX is imported lazily: it costs
seconds, and only the stages that gate need it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from apprentice.gate.columns import add_derived
from apprentice.gate.results import MAX_IDS, Check, GateResult, episode_name

SUITES_DIR = Path(__file__).resolve().parents[2] / "expectations"


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
    frame = add_derived(df, spec.get("meta", {}), params)
    fmt: dict[str, Any] = {"result_format": "COMPLETE", "partial_unexpected_count": 5}
    if "problem_id" in frame.columns:  # every failed row expectation lists the problem ids it failed on
        fmt["unexpected_index_column_names"] = ["problem_id"] + (["sample_idx"] if "sample_idx" in frame.columns else [])
    result = batch_def.get_batch(batch_parameters={"dataframe": frame}).validate(
        gx_suite, expectation_parameters=dict(params or {}), result_format=fmt)
    res = json.loads(json.dumps(result.to_json_dict(), default=str))  # numpy scalars -> plain JSON
    checks = []
    for r in res["results"]:
        cfg, out = r["expectation_config"], r.get("result") or {}
        kwargs = {k: v for k, v in cfg["kwargs"].items() if k != "batch_id"}
        if isinstance(kwargs.get("value_set"), list) and len(kwargs["value_set"]) > 8:
            kwargs["value_set"] = f"<{len(kwargs['value_set'])} values>"
        index = [x for x in out.get("unexpected_index_list") or [] if isinstance(x, dict)]
        ids = [str(x.get("problem_id")) for x in index]
        eps = [episode_name(x.get("problem_id"), x["sample_idx"]) for x in index if "sample_idx" in x]
        checks.append(Check(cfg["type"], kwargs, bool(r["success"]), out.get("observed_value"),
                            out.get("unexpected_count"), (out.get("partial_unexpected_list") or [])[:5],
                            list(dict.fromkeys(ids))[:MAX_IDS], list(dict.fromkeys(eps))[:MAX_IDS]))
        if r.get("exception_info", {}).get("raised_exception"):
            checks[-1].observed = r["exception_info"].get("exception_message")
    return GateResult(spec["name"], table or suite, len(df), checks)
