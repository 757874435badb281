"""bench/ holds the benchmarks `make bench` reruns; experiments/ holds finished studies, each cited in the log.

A script in bench/ that `make bench` does not run rots unnoticed (its imports drift with the package), and
an experiment nobody cites is one nobody can read the result of: both are layout errors, caught here.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _bench_recipe() -> str:
    """The recipe lines of the Makefile's ``bench`` target (up to the first blank line)."""
    text = (REPO / "Makefile").read_text()
    head = re.search(r"^bench:.*$", text, re.M)
    assert head, "the Makefile has no bench target"
    return text[head.end():].split("\n\n", 1)[0]


def test_make_bench_runs_every_script_in_bench_and_nothing_else():
    scripts = {p.name for p in (REPO / "bench").glob("*.py")}
    ran = set(re.findall(r"\bbench/(\w+\.py)\b", _bench_recipe()))
    assert scripts, "bench/ holds no scripts"
    assert scripts - ran == set(), f"in bench/ but not run by `make bench`: {sorted(scripts - ran)}"
    assert ran - scripts == set(), f"run by `make bench` but not in bench/: {sorted(ran - scripts)}"


def test_every_experiment_is_cited_in_the_experiments_log():
    log = (REPO / "docs" / "experiments.md").read_text()
    scripts = sorted(p.name for p in (REPO / "experiments").glob("*.py"))
    uncited = [s for s in scripts if f"experiments/{s}" not in log]
    assert not uncited, f"experiments/ scripts docs/experiments.md does not cite: {uncited}"


def test_scripts_the_experiments_log_names_exist():
    log = (REPO / "docs" / "experiments.md").read_text()
    named = set(re.findall(r"\b((?:bench|experiments)/\w+\.py)\b", log))
    missing = sorted(p for p in named if not (REPO / p).is_file())
    assert not missing, f"docs/experiments.md names scripts that are not there: {missing}"


def test_bench_and_experiments_share_no_script_name():
    """A name in both places would make a command in the docs ambiguous after a move."""
    both = {p.name for p in (REPO / "bench").glob("*.py")} & {p.name for p in (REPO / "experiments").glob("*.py")}
    assert not both, sorted(both)
