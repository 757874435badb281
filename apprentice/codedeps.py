"""Which project code a stage runs: the import graph of its module, read from the source.

Why derived and not a hand-kept table: a table drifts. A hand-kept one had the SFT stage missing
``trajectories.py``, evaluation missing ``modeling.py`` and RL missing ``policies/hf_cached.py``,
so DVC kept stale results after a change there. Here every ``import``/``from ... import``
statement anywhere in a module (function-local lazy imports included, since most heavy imports
are lazy) and every ``importlib.import_module("constant")`` is followed through the project's own
packages; the transitive closure is what the stage can execute. Modules loaded by computed names
(the built-in environment families, plugins) are covered by listing their package directory whole
(:data:`WHOLE_PACKAGES`).

The same closure feeds the DVC stage deps (:mod:`apprentice.ops.dvcgen`) and the code part of the
stages' own skip-fingerprints (:func:`digest`), so the plain CLI and ``dvc repro`` agree on what
"the code changed" means.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: Top-level packages that are this project (everything else is third-party).
PROJECT_PACKAGES = ("apprentice",)

#: Packages that load their members by computed name: a dependency on any module inside means a
#: dependency on the whole directory.
WHOLE_PACKAGES = ("apprentice/envs", "apprentice/policies", "apprentice/training")

#: Third-party distributions whose version changes what a stage computes.
VERSIONED = ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "great_expectations",
             "reasoning_gym", "gymnasium", "pandas", "pyarrow")


def module_file(name: str, repo: Path = REPO) -> Path | None:
    """The source file of project module ``name`` (a package's ``__init__.py``), or None."""
    if name.split(".")[0] not in PROJECT_PACKAGES:
        return None
    base = repo.joinpath(*name.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _module_name(path: Path, repo: Path) -> str:
    rel = path.relative_to(repo).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _parse(path: Path) -> ast.Module:
    """``ast.parse``, retried on CPython 3.11's spurious "AST constructor recursion depth mismatch"
    (python/cpython#106905, fixed in 3.11.8): Debian bookworm's 3.11.2, the pipeline image's Python,
    raises it now and then when a flow runs this in a worker thread. The source is the same, so a
    second parse succeeds; a real syntax error still raises at once."""
    source = Path(path).read_text()
    for attempt in range(3):
        try:
            return ast.parse(source, filename=str(path))
        except SystemError as e:
            if "recursion depth mismatch" not in str(e) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def imports_of(path: Path, repo: Path = REPO) -> set[str]:
    """Project modules ``path`` imports anywhere (top level, in functions, importlib with a constant)."""
    tree = _parse(Path(path))
    me = _module_name(Path(path), repo)
    pkg = me if Path(path).name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()

    def add(name: str) -> None:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__ too
            prefix = ".".join(parts[:i])
            if module_file(prefix, repo) is not None:
                found.add(prefix)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = pkg.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)] if node.level > 1 else anchor
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            add(base)
            for a in node.names:  # `from pkg import module`
                add(f"{base}.{a.name}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            add(node.args[0].value)
    found.discard(me)
    return found


def closure(modules: Iterable[str], repo: Path = REPO) -> list[Path]:
    """Source files of ``modules`` and every project module they import, transitively (sorted)."""
    return list(_closure(tuple(sorted(modules)), repo))


@functools.lru_cache(maxsize=64)
def _closure(modules: tuple[str, ...], repo: Path) -> tuple[Path, ...]:
    todo = list(modules)
    seen: dict[str, Path] = {}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        f = module_file(name, repo)
        if f is None:
            raise ModuleNotFoundError(f"project module '{name}' has no source under {repo}")
        seen[name] = f
        # a package's members run its __init__ first
        parent = name.rpartition(".")[0]
        if parent and parent not in seen:
            todo.append(parent)
        todo.extend(m for m in imports_of(f, repo) if m not in seen)
    return tuple(sorted(set(seen.values())))


def deps(modules: Iterable[str], repo: Path = REPO) -> list[str]:
    """Repo-relative code deps of ``modules`` for dvc.yaml: files, with :data:`WHOLE_PACKAGES` collapsed
    to their directory (sorted, no duplicates)."""
    out: set[str] = set()
    for f in closure(modules, repo):
        rel = f.relative_to(repo).as_posix()
        whole = next((p for p in WHOLE_PACKAGES if rel.startswith(p + "/")), None)
        out.add(whole or rel)
    return sorted(out)


def versions(dists: Iterable[str] = VERSIONED) -> dict[str, str]:
    """Installed versions of the third-party distributions a stage's output depends on."""
    return dict(_versions(tuple(dists)))


@functools.lru_cache(maxsize=8)
def _versions(dists: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    out = {}
    for d in dists:
        try:
            out[d] = importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            out[d] = "absent"
    return tuple(sorted(out.items()))


def digest(*modules: str, repo: Path | None = None) -> str:
    """SHA-256 (16 hex) of the code ``modules`` run (every file of their closure, whole packages
    included) and of the third-party versions: the code part of a stage's skip-fingerprint."""
    repo = Path(repo) if repo is not None else REPO
    h = hashlib.sha256()
    files: set[Path] = set()
    for d in deps(modules, repo):
        p = repo / d
        files.update(sorted(p.rglob("*.py")) if p.is_dir() else [p])
    for f in sorted(files):
        h.update(f.relative_to(repo).as_posix().encode())
        h.update(f.read_bytes())
    h.update(repr(sorted(versions().items())).encode())
    return h.hexdigest()[:16]
