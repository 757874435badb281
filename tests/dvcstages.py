"""The stages DVC runs for a ``dvc.yaml`` mapping: matrix members expanded by DVC's own resolver.

Tests that look at one generated stage (``evaluate-1@rl``) read it through this, so they see the
command, deps and outs DVC will execute, not the matrix template ``dvcgen`` writes.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any


def expand(stages: dict[str, Any]) -> dict[str, Any]:
    """``{dvc stage name: resolved spec}`` for the ``stages`` mapping of a ``dvc.yaml``."""
    from dvc.parsing import DataResolver
    from dvc.repo import Repo

    with tempfile.TemporaryDirectory() as root, Repo.init(root, no_scm=True) as repo:
        resolved = DataResolver(repo, root, {"stages": stages}).resolve()["stages"]
    return json.loads(json.dumps(resolved))


def expand_file(path: Path) -> dict[str, Any]:
    import yaml

    return expand(yaml.safe_load(Path(path).read_text())["stages"])
