"""Trajectory and problem tables: schema, atomic Parquet I/O, conversion to TRL datasets.

A trajectory row carries the spec, the policy id and every message; training reads nothing else.
Nested fields (messages, tools, spec, difficulty) are stored as JSON strings: Parquet nested types
round-trip poorly through pandas for ragged tool-call arguments, and JSON keeps rows self-describing
for the Great Expectations gates.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from apprentice.envs.base import ProblemSpec
from apprentice.paths import atomic_path

PROBLEM_COLUMNS = ["problem_id", "family", "seed", "generation", "level", "difficulty", "spec", "split"]


@dataclass
class Trajectory:
    problem_id: str
    family: str
    spec: str  # ProblemSpec JSON
    difficulty: str  # JSON of the difficulty vector
    level: int
    policy_id: str
    sample_idx: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    reward: float
    success: bool
    turns: int
    truncated: bool
    tool_errors: int = 0
    parse_errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_row(self) -> dict[str, Any]:
        row = asdict(self)
        row["messages"] = json.dumps(self.messages, sort_keys=True)
        row["tools"] = json.dumps(self.tools, sort_keys=True)
        row["extra"] = json.dumps(self.extra, sort_keys=True)
        return row


TRAJECTORY_COLUMNS = list(Trajectory.__dataclass_fields__)


def problems_frame(specs: Iterable[ProblemSpec], levels: Iterable[int], split: str) -> pd.DataFrame:
    rows = [
        {
            "problem_id": s.problem_id,
            "family": s.family,
            "seed": s.seed,
            "generation": s.generation,
            "level": int(lv),
            "difficulty": json.dumps(dict(sorted(s.difficulty.items()))),
            "spec": s.to_json(),
            "split": split,
        }
        for s, lv in zip(specs, levels, strict=True)
    ]
    return pd.DataFrame(rows, columns=PROBLEM_COLUMNS)


def specs_of(df: pd.DataFrame) -> list[ProblemSpec]:
    return [ProblemSpec.from_json(s) for s in df["spec"]]


def trajectories_frame(trajs: Iterable[Trajectory]) -> pd.DataFrame:
    return pd.DataFrame([t.to_row() for t in trajs], columns=TRAJECTORY_COLUMNS)


def write_parquet(df: pd.DataFrame, path: str | Path) -> Path:
    """Write atomically: temp file beside the target, then rename."""
    path = Path(path)
    with atomic_path(path) as tmp:
        df.to_parquet(tmp, index=False)
    return path


def read_parquet(path: str | Path) -> pd.DataFrame:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; run the stage that produces it first")
    return pd.read_parquet(path)


def messages_of(row: dict[str, Any] | pd.Series) -> list[dict[str, Any]]:
    return json.loads(row["messages"])


def to_sft_records(df: pd.DataFrame) -> list[dict[str, Any]]:
    """Rows -> TRL conversational tool-calling records ``{"messages": [...], "tools": [...]}``."""
    return [{"messages": json.loads(m), "tools": json.loads(t)} for m, t in zip(df["messages"], df["tools"], strict=True)]
