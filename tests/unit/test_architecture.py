"""The layers (docs/architecture.md), enforced on the imports each module makes.

- the library (``envs``, ``policies``, ``rollout``, ``training``, ``evaluation``, ``curriculum``, ``data``,
  ``lm``) imports no orchestration (Prefect, ``tasks/``, ``flows/``), no tracking (MLflow, DVC), no data
  quality (GX, ``apprentice.gate``), no ops glue and no stage;
- Prefect only in ``tasks/`` and ``flows/``; MLflow only in ``apprentice/ops/lineage.py``; Great
  Expectations only in ``apprentice/gate/gx.py``;
- infrastructure (``apprentice/infra``) imports no orchestration, tracking, gate or stage;
- policies never import environments; artifact paths are built only in ``apprentice/paths.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("envs", "policies", "rollout", "training", "evaluation", "curriculum", "data", "lm")
ORCHESTRATION = {"prefect", "prefect_ray", "prefect_docker", "tasks", "flows"}
TRACKING = {"mlflow", "dvc"}  # DVCLive is a trainer callback that writes files: allowed


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            if node.module == "apprentice":  # from apprentice import gate -> apprentice.gate
                out.update(f"apprentice.{a.name}" for a in node.names)
    return out


def _py(dirname: str) -> list[Path]:
    return sorted((ROOT / dirname).rglob("*.py"))


def _top(mods: set[str]) -> set[str]:
    return {m.split(".")[0] for m in mods}


def _inside(mods: set[str], *packages: str) -> set[str]:
    return {m for m in mods if any(m == p or m.startswith(p + ".") for p in packages)}


def test_the_layers_are_folders():
    """Every layer the docs name is a package; the top level holds only the spine."""
    for pkg in (*LIBRARY, "gate", "ops", "infra", "stages"):
        assert (ROOT / "apprentice" / pkg / "__init__.py").is_file(), pkg
    top = sorted(p.stem for p in (ROOT / "apprentice").glob("*.py"))
    assert top == ["__init__", "__main__", "codedeps", "config", "paths", "pipeline", "progress"], top


@pytest.mark.parametrize("layer", LIBRARY)
def test_library_imports_no_orchestration_tracking_gate_or_ops(layer):
    offenders = []
    for p in _py(f"apprentice/{layer}"):
        mods = _imports(p)
        bad = (_top(mods) & (ORCHESTRATION | TRACKING | {"great_expectations"})) | _inside(
            mods, "apprentice.gate", "apprentice.ops", "apprentice.stages")
        if bad:
            offenders.append(f"{p.relative_to(ROOT)}: {sorted(bad)}")
    assert not offenders, "the library must not import these:\n" + "\n".join(offenders)


def test_infrastructure_imports_no_orchestration_tracking_or_gate():
    offenders = []
    for p in _py("apprentice/infra"):
        mods = _imports(p)
        bad = (_top(mods) & (ORCHESTRATION | TRACKING | {"great_expectations"})) | _inside(
            mods, "apprentice.gate", "apprentice.ops", "apprentice.stages")
        if bad:
            offenders.append(f"{p.relative_to(ROOT)}: {sorted(bad)}")
    assert not offenders, "\n".join(offenders)


def test_prefect_only_in_tasks_and_flows():
    offenders = [p for p in _py("apprentice") if _top(_imports(p)) & {"prefect", "prefect_ray", "prefect_docker"}]
    assert not offenders, f"prefect imported outside tasks/ and flows/: {offenders}"


def test_mlflow_only_in_lineage():
    lineage = ROOT / "apprentice" / "ops" / "lineage.py"
    offenders = [p for p in _py("apprentice") + _py("tasks") + _py("flows")
                 if "mlflow" in _top(_imports(p)) and p != lineage]
    assert not offenders, f"mlflow imported outside apprentice/ops/lineage.py: {offenders}"


def test_great_expectations_only_in_the_gate():
    gx = ROOT / "apprentice" / "gate" / "gx.py"
    offenders = [p for p in _py("apprentice") + _py("tasks") + _py("flows")
                 if "great_expectations" in _top(_imports(p)) and p != gx]
    assert not offenders, f"great_expectations imported outside apprentice/gate/gx.py: {offenders}"


def test_library_never_imports_orchestration():
    offenders = [p for p in _py("apprentice") if _top(_imports(p)) & {"tasks", "flows"}]
    assert not offenders, f"apprentice/ imports tasks/ or flows/: {offenders}"


def test_policies_do_not_import_environments():
    offenders = [p for p in (ROOT / "apprentice" / "policies").rglob("*.py")
                 if any(m.startswith("apprentice.envs") for m in _imports(p))]
    assert not offenders, f"policies import environments: {offenders}"


def _text(node: ast.expr) -> str | None:
    """A string expression's text, each f-string field as ``{}``; None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def test_artifact_paths_are_built_only_in_paths_py():
    """Where iteration k's artifacts live is apprentice/paths.py's to say: a stage, task or flow that
    joins ``folder / "gen_{g}.parquet"`` or spells ``iter_{k}`` itself drifts from dvc.yaml the day
    paths.py changes. Checked: every ``path / "<string>"`` naming a parquet table, every string that
    spells an iteration folder (messages and docstrings may still *mention* a path in prose)."""
    offenders = []
    for p in _py("apprentice") + _py("tasks") + _py("flows"):
        if p.name in ("paths.py", "shards.py"):  # shards.py names the shard files of a stage's own scratch folder
            continue
        for node in ast.walk(ast.parse(p.read_text(), filename=str(p))):
            joined = _text(node.right) if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) else None
            if joined is not None and joined.endswith(".parquet"):
                offenders.append(f"{p.relative_to(ROOT)}:{node.lineno}: / {joined!r}")
            text = _text(node) if isinstance(node, ast.Constant | ast.JoinedStr) else None
            if text is not None and ("iter_{}" in text or text == "iter_") and " " not in text:
                offenders.append(f"{p.relative_to(ROOT)}:{node.lineno}: {text!r}")
    assert not offenders, "build these paths with apprentice.paths.Paths:\n" + "\n".join(offenders)


def test_episode_stages_build_policies_through_the_policies_package_not_another_stage():
    """evaluate once built its policy through stages/rollout.py: a stage importing a stage, which
    hid the policy construction from the policies package and tied the two stages' code together."""
    for name in ("evaluate.py", "rollout.py"):
        stages = {m for m in _imports(ROOT / "apprentice" / "stages" / name) if m.startswith("apprentice.stages")}
        assert not stages, f"apprentice/stages/{name} imports another stage: {sorted(stages)}"
    defs = [p for p in _py("apprentice") if "def build_policy(" in p.read_text()]
    assert defs == [ROOT / "apprentice" / "policies" / "factory.py"], defs


def test_no_stage_takes_policy_construction_from_another_stage():
    """Every stage gets policies from :mod:`apprentice.policies.factory`, never through another stage:
    a stage importing another stage ties the two stages' code (and their DVC code deps) together."""
    offenders = []
    for p in sorted((ROOT / "apprentice" / "stages").glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("apprentice.stages"):
                names = {a.name for a in node.names} & {"build_policy", "resolve_policy", "MODEL_CHOICES"}
                if names:
                    offenders.append(f"{p.relative_to(ROOT)}:{node.lineno}: {sorted(names)} from {node.module}")
    assert not offenders, "import these from apprentice.policies.factory:\n" + "\n".join(offenders)
