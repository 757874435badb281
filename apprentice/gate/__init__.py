"""The data gate: what decides that a table may reach training. The one package that knows GX.

A failing gate stops everything downstream: ``validate`` writes no SFT set, and ``sft`` / ``distill``
train only on the file whose SHA-256 a passed gate record names.

- :mod:`~apprentice.gate.results`: what a check returns and the error a failed gate raises;
- :mod:`~apprentice.gate.columns`: derived columns, the per-row checks a suite asserts;
- :mod:`~apprentice.gate.audit`: the episode audit (every way a transcript can lie) and which
  episodes are kept out of the SFT set, and why;
- :mod:`~apprentice.gate.secrets`: what the agent could know at each step (secrets, derived values);
- :mod:`~apprentice.gate.protocol`: the chat template's control tokens and markup no content may hold;
- :mod:`~apprentice.gate.gx`: the Great Expectations glue (the only ``great_expectations`` import);
- :mod:`~apprentice.gate.report`: the HTML report and the JSON record that gates training.
"""

from apprentice.gate.audit import (
    EPISODE_CHECKS,
    audit_episode,
    episode_rejections,
    row_rejections,
    sft_exclusions,
    spec_problem,
    text_problem,
)
from apprentice.gate.gx import check, load_suite
from apprentice.gate.protocol import use as use_protocol
from apprentice.gate.report import raise_if_failed, reason_counts, render_html, require_passed, write_reports
from apprentice.gate.results import Check, GateFailed, GateResult, episode_name

__all__ = ["EPISODE_CHECKS", "Check", "GateFailed", "GateResult", "audit_episode", "check", "episode_name",
           "episode_rejections", "load_suite", "raise_if_failed", "reason_counts", "render_html", "require_passed",
           "row_rejections", "sft_exclusions", "spec_problem", "text_problem", "use_protocol", "write_reports"]
