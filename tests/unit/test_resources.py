"""The per-stage resource record (``reports/resources.jsonl``) and the table ``make run`` prints from it."""

from __future__ import annotations

import json

import torch

from apprentice.__main__ import record_resources
from flows.self_improve import resource_table


def test_a_stage_record_carries_wall_time_peak_memory_and_the_thread_count_it_computed_with(tmp_path, monkeypatch):
    monkeypatch.setenv("APPRENTICE_FLOW_RUN", "run-a")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        rec = record_resources(tmp_path, "evaluate", 2, "rl", 12.34)
    finally:
        torch.set_num_threads(before)
    line = json.loads((tmp_path / "reports" / "resources.jsonl").read_text().splitlines()[-1])
    assert line == rec
    assert rec["stage"] == "evaluate-rl" and rec["iteration"] == 2 and rec["wall_s"] == 12.3
    assert rec["peak_rss_gb"] > 0 and rec["flow_run"] == "run-a"
    assert rec["torch_threads"] == 1


def test_the_table_lists_only_this_flow_run_sums_each_iteration_and_names_the_thread_counts(tmp_path):
    log = tmp_path / "reports" / "resources.jsonl"
    log.parent.mkdir(parents=True)
    rows = [
        {"stage": "sft", "iteration": 1, "wall_s": 60.0, "peak_rss_gb": 5.1, "flow_run": "mine", "torch_threads": 2},
        {"stage": "synth", "iteration": 1, "wall_s": 30.0, "peak_rss_gb": 0.2, "flow_run": "mine"},  # no torch
        {"stage": "rl", "iteration": 2, "wall_s": 120.0, "peak_rss_gb": 5.4, "flow_run": "mine", "torch_threads": 4},
        {"stage": "rl", "iteration": 2, "wall_s": 999.0, "peak_rss_gb": 9.9, "flow_run": "other", "torch_threads": 8},
    ]
    log.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    table = resource_table(tmp_path, "mine", 300.0)
    assert "iter 1: 1.5 min, iter 2: 2.0 min" in table
    assert "peak RSS of any stage: 5.40 GB" in table and "9.9" not in table
    assert "torch threads per stage: 2, 4" in table and "8" not in table.splitlines()[-1]
    assert "model.threads" in table
