"""CI fails on lint and type errors, not only on failing tests, so style and type breaks cannot land green."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_ci_runs_make_lint_and_lint_runs_ruff_and_mypy():
    script = (REPO / ".ci" / "run").read_text()
    assert "set -euo pipefail" in script and re.search(r"^make lint$", script, re.M), script
    lint = (REPO / "Makefile").read_text().split("\nlint:", 1)[1].split("\n\n", 1)[0]
    assert "ruff check" in lint and "mypy apprentice" in lint
