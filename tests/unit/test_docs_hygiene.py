"""What a reader can check in the code's prose: it cites only what the repository holds, and it does not
go stale.

Comments, docstrings and config comments say *why*; measurements live in ``docs/performance.md`` and
``docs/experiments.md`` (dated, with machine, dtype, commit and command). So prose outside those two
files carries no commit hashes and no dates, nothing anywhere carries the letters of the issues that
asked for a change (a reader has no issue tracker), and every file a text names exists.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: the measurement logs (dated entries that name their commit), and the README, whose results table says
#: which commit, date, machine and dtype produced it
LOGS = {"docs/performance.md", "docs/experiments.md", "README.md"}
ISSUE_LETTER = re.compile(r"\b[Ii]ssues? [A-Z]\b(?!-)|§ ?[A-Z]\.\d|\([A-Z],? item \d|\bitem \d+ of [A-Z]\b|\b[A-Z]'s (budget|target)s?\b")
COMMIT = re.compile(r"(?<![\w./:@#-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}(?![\w-])")
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
#: a document cited by its upper-case file name (e.g. the README): the repository must hold that file
CITED_DOC = re.compile(r"(?<![\w/.-])([A-Z][A-Z0-9_]*(?:-[A-Z0-9_]+)*\.md)\b")
#: a design-notes file cited without its extension (an upper-case name ending in -NOTES or -ANCHORS)
NOTES_FILE = re.compile(r"\b[A-Z][A-Z0-9]*(?:-[A-Z0-9]+)*-(?:NOTES|ANCHORS)\b")
#: a path into the repository named in prose
REPO_PATH = re.compile(r"(?<![\w./-])((?:apprentice|tasks|flows|tests|bench|experiments|scripts|docs|expectations)/"
                       r"[\w./-]*\w\.(?:py|md|yaml|yml|json|sh|jinja|png))\b")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    return [f for f in out if (ROOT / f).is_file()]


def _prose_of_python(text: str) -> list[tuple[int, str]]:
    """Comments and docstrings of a Python file, with their line numbers."""
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(text).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc and node.body:
                out.append((node.body[0].lineno, doc))
    return out


def _prose(path: str) -> list[tuple[int, str]]:
    text = (ROOT / path).read_text(errors="replace")
    if path.endswith(".py"):
        return _prose_of_python(text)
    if path.endswith(".md"):
        return list(enumerate(text.splitlines(), 1))
    # yaml, toml, Makefile, shell, Dockerfile: the comments
    return [(i, line[line.index("#"):]) for i, line in enumerate(text.splitlines(), 1) if "#" in line]


def _files() -> list[str]:
    keep = (".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".cfg")
    names = {"Makefile", "Dockerfile", ".ci/run"}
    return [f for f in _tracked() if (f.endswith(keep) or f in names)
            and not f.startswith(("tests/unit/fixtures/", "docs/results/")) and f != "dvc.yaml"]


def _offenders(pattern: re.Pattern[str], files: list[str]) -> list[str]:
    hits = []
    for f in files:
        for line, text in _prose(f):
            for m in pattern.finditer(text):
                hits.append(f"{f}:{line}: {m.group(0)!r}")
    return hits


def test_no_issue_letters_anywhere():
    hits = _offenders(ISSUE_LETTER, _files())
    assert not hits, "name the subject, not the issue that asked for it:\n" + "\n".join(hits)


def test_no_commit_hashes_or_dates_outside_the_measurement_logs():
    files = [f for f in _files() if f not in LOGS]
    hits = _offenders(COMMIT, files) + _offenders(DATE, files)
    assert not hits, ("hashes and dates go stale; put the figure in docs/performance.md or docs/experiments.md:\n"
                      + "\n".join(hits))


def test_nothing_cites_a_document_outside_the_repository():
    """A reader can open every document the prose names: an upper-case ``.md`` name must be a file of the repository, and
    no design-notes file is cited at all (cite the paper, or write what is needed into docs/)."""
    held = {Path(f).name for f in _tracked()}
    hits = [h for h in _offenders(CITED_DOC, _files()) if h.rsplit(": ", 1)[1].strip("'") not in held]
    hits += _offenders(NOTES_FILE, _files())
    assert not hits, "cite the paper (title, arXiv id) or write what is needed into docs/:\n" + "\n".join(hits)


def test_every_repository_path_named_in_prose_exists():
    missing = []
    for f in _files():
        for line, text in _prose(f):
            for m in REPO_PATH.finditer(text):
                target = m.group(1)
                if "<" in target or "*" in target or "{" in target:
                    continue
                if not (ROOT / target).exists() and not (ROOT / Path(f).parent / target).exists():
                    missing.append(f"{f}:{line}: {target}")
    assert not missing, "these paths do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("doc", ["README.md", "docs/architecture.md"])
def test_markdown_links_resolve(doc):
    text = (ROOT / doc).read_text()
    broken = [t for t in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
              if not t.startswith(("http://", "https://")) and not (ROOT / doc).parent.joinpath(t).exists()]
    assert not broken, broken


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; history belongs in docs/performance.md"
