"""The iteration report opened from disk in headless Debian Chromium (skipped where chromium and
chromium-driver are not installed; ``.ci/run`` installs them): it lays out every section, draws
every chart, and fetches nothing."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "slow"))

from test_report_html import test_report_shows_every_section_from_stage_outputs as build  # noqa: E402
from uitools import chromium, require_chromium, wait_for  # noqa: E402


def test_report_renders_in_chromium_without_network(tmp_path):
    require_chromium()
    build(tmp_path)  # writes reports/iter_2/index.html from stage-output files
    with chromium() as d:
        d.get((tmp_path / "reports/iter_2/index.html").as_uri())
        text = wait_for(d, lambda t: "Lineage" in t and "Learning table" in t, "the report")
        assert "kept as challenger" in text and "No distill training log yet" in text
        sizes = d.execute_script("return [...document.querySelectorAll('svg')].map(s => s.getBoundingClientRect().width)")
        assert len(sizes) >= 4 and min(sizes) > 100, sizes
        assert d.execute_script("return performance.getEntriesByType('resource').length") == 0
        # the page fits a laptop screen's width: no horizontal scrolling
        assert d.execute_script("return document.documentElement.scrollWidth <= window.innerWidth + 1")
