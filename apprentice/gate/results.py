"""What a gate check returns: one expectation's outcome (:class:`Check`), a suite's result
(:class:`GateResult`), the error a failed gate raises (:class:`GateFailed`), and how the report names
one episode (:func:`episode_name`). Plain data, no GX: every other gate module builds on it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: problem ids kept per failed expectation in the report (the count is always exact)
MAX_IDS = 200


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
    problem_ids: list[str] = field(default_factory=list)
    #: the failing rows as "problem id / sample k" (tables with a ``sample_idx``)
    episodes: list[str] = field(default_factory=list)

    def line(self) -> str:
        what = ", ".join(f"{k}={_short(v)}" for k, v in self.kwargs.items())
        bits = []
        if self.observed is not None:
            bits.append(f"observed {_short(self.observed)}")
        if self.unexpected_count:
            bits.append(f"{self.unexpected_count} bad rows, e.g. {_short(self.examples)}")
        if self.episodes:
            bits.append(f"episodes {_short(self.episodes, 600)}")
        elif self.problem_ids:
            bits.append(f"problem ids {_short(self.problem_ids, 400)}")
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


def episode_name(problem_id: Any, sample_idx: Any) -> str:
    """How the report names one episode: ``<problem id>/sample <k>``."""
    k = sample_idx.item() if hasattr(sample_idx, "item") else sample_idx
    return f"{problem_id}/sample {k}"


def _short(v: Any, n: int = 160) -> str:
    s = json.dumps(v, default=str) if not isinstance(v, str) else v
    return s if len(s) <= n else s[: n - 3] + "..."
