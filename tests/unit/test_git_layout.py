"""The repository's git layout keeps DVC working on a fresh clone.

DVC refuses a git-ignored ``dvc.lock`` (``'<clone>/dvc.lock' is git-ignored``), so an ignore rule
that catches a pipeline file breaks ``make run`` and ``dvc repro`` on every fresh clone while the test
suite (which runs in temp dirs) stays green: a ``/runs/`` or a ``/dvc.lock`` line would each do it.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from apprentice.config import ConfigError
from apprentice.ops import dvcgen

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ["default", *sorted(p.stem for p in (ROOT / "apprentice" / "profiles").glob("*.yaml"))]

pytestmark = pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                                reason="needs git and a git checkout")


@pytest.mark.parametrize("profile", PROFILES)
def test_no_gitignore_rule_hides_a_pipeline_file_of_any_profile(profile):
    wd = dvcgen.workdir(profile, ROOT)
    wd.mkdir(parents=True, exist_ok=True)  # check-ignore needs the folder, not the files
    assert dvcgen.ignored_pipeline_files(wd) == [], f"DVC would refuse {profile}'s pipeline files"


def test_the_guard_names_the_rule_and_the_generator_refuses_to_run(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("/data/\n/dvc.lock\n")
    assert dvcgen.ignored_pipeline_files(tmp_path) == [".gitignore:2:/dvc.lock\tdvc.lock"]
    with pytest.raises(ConfigError, match=r"(?s)\.gitignore:2:/dvc\.lock.*remove those lines"):
        dvcgen.refuse_ignored_pipeline_files(tmp_path)
    (tmp_path / ".gitignore").write_text("/data/\n")
    dvcgen.refuse_ignored_pipeline_files(tmp_path)  # no rule, no error


def test_a_folder_outside_git_is_not_checked(tmp_path):
    assert dvcgen.ignored_pipeline_files(tmp_path) == []
