"""The iteration report of a real deployed run (two iterations of the quick profile), rendered
in headless Chromium from disk with the network unused: every section, every chart, no fetch."""

from __future__ import annotations

from uitools import chromium, screenshot, slow_only, wait_for

pytestmark = slow_only()

SECTIONS = ["Learning table", "Per level and per family", "Learning curves", "Data gate", "Promotion",
            "Champion across iterations", "Lineage"]


def test_report_of_a_deployed_run_renders_offline(deployed):
    page = deployed["wd"] / "reports/iter_2/index.html"
    with chromium() as d:
        d.get(page.as_uri())
        text = wait_for(d, lambda t: all(s in t for s in SECTIONS), "every section")
        assert "iteration 1" in text and "iteration 2" in text  # the champion trend spans both iterations
        for stage in ("sft-2", "rl-2", "distill-2", "promote-2", "iter-2"):
            assert stage in text, f"MLflow run of {stage} missing from the lineage section"
        assert "models/iter_2/rl" in text and "exact McNemar" in text
        sizes = d.execute_script("return [...document.querySelectorAll('svg')].map(s => s.getBoundingClientRect().width)")
        assert len(sizes) >= 5 and min(sizes) > 100, sizes  # success, sft/rl/distill curves, trend
        assert d.execute_script("return performance.getEntriesByType('resource').length") == 0
        screenshot(d, "report_iter_2", full_page=True)
