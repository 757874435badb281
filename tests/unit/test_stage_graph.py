"""The DVC stage graph every profile generates is pinned in a fixture.

Why a snapshot: the graph is derived from the stage registry (:mod:`apprentice.pipeline`), the
import graph of each stage's code and the params, so a change to any of them can change what DVC
runs without any test of a single stage noticing. Pinning it turns every such change into a diff
someone reviews, for every profile: stage names, commands, deps (code and data), outs, params per
key, metrics and plots. The fixture was first written by the generator from the hand-kept tables
the registry replaced, so it also holds the registry to the pipeline those tables described (the
per-model evaluations renamed to DVC's matrix names, ``evaluate-rl-1`` -> ``evaluate-1@rl``).

The graph compared is the one DVC itself runs: the generated mapping expanded by DVC's own resolver
(``dvc.parsing.DataResolver``), so a matrix member is compared as the stage DVC will execute. A
deliberate change to the graph regenerates it with
``APPRENTICE_UPDATE_GRAPH=1 python -m pytest tests/unit/test_stage_graph.py`` (review its diff).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dvcstages import expand

from apprentice.config import PROFILES_DIR, load_raw
from apprentice.ops import dvcgen

REPO = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).parent / "fixtures" / "dvc_stage_graph.json"


def graphs() -> dict[str, Any]:
    """``dvcgen.pipeline`` of every profile (as ``dvcgen.write`` renders it), plus a hub-id base model."""
    out: dict[str, Any] = {}
    for profile in ["default", *sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))]:
        raw = load_raw(REPO / "params.yaml", profile)
        prefix = "" if profile == "default" else "../../"
        out[profile] = dvcgen.pipeline(raw, prefix, REPO)
    raw = load_raw(REPO / "params.yaml")
    raw["model"]["base"] = "HuggingFaceTB/SmolLM2-135M-Instruct"  # not built: no folder dep, no prepare-base out
    out["default+hub-base"] = dvcgen.pipeline(raw, "", REPO)
    return json.loads(json.dumps(out))  # tuples -> lists, as YAML would render them


def test_every_profile_generates_the_pinned_stage_graph():
    got = {profile: {**p, "stages": expand(p["stages"])} for profile, p in graphs().items()}
    if os.environ.get("APPRENTICE_UPDATE_GRAPH"):
        FIXTURE.write_text(json.dumps(got, indent=1) + "\n")
    want = json.loads(FIXTURE.read_text())
    assert sorted(got) == sorted(want)
    for profile in want:
        g, w = got[profile], want[profile]
        assert list(g["stages"]) == list(w["stages"]), f"{profile}: stage names/order differ"
        for name in w["stages"]:
            assert g["stages"][name] == w["stages"][name], f"{profile}: DVC stage {name} differs"
        assert g["metrics"] == w["metrics"] and g["plots"] == w["plots"], f"{profile}: metrics/plots differ"
        assert g == w


def test_per_model_evaluation_is_one_dvc_matrix_per_iteration():
    stages = graphs()["default"]["stages"]
    ev = stages["evaluate-1"]
    assert ev["matrix"] == {"policy": ["sft", "rl", "student"]}
    assert "--policy ${item.policy}" in ev["cmd"] and "models/iter_1/${item.policy}" in ev["deps"]
    assert "evaluate-base" in stages and "matrix" not in stages["evaluate-base"]  # scored once, no iteration
    assert dvcgen.dvc_stages("evaluate", 2) == ["evaluate-base", "evaluate-2@sft", "evaluate-2@rl", "evaluate-2@student"]
