"""What extending Apprentice costs: the files a throwaway stage, environment family and OPD variant touch.

For each extension the script checks out ``--ref`` (default ``HEAD``) into a
temporary git worktree, writes the throwaway example the way the README says to, proves it is live (the
stage is a CLI verb, a DVC stage, a Prefect task and a place in the flow's order; the family passes
``check-env``; the variant's knob reaches its recipe), and prints the files it touched: hand-written
ones with the lines they gained (the diff size), and separately the ones a generator rewrote
(``dvc.yaml``). The counts before the stage registry, and the ones it brought, are logged in
docs/experiments.md (What extending costs).

    python experiments/extension_cost.py            # on HEAD (the CLI and Prefect imports take most of its time)

Why by hand: no library measures "files touched to add X"; it is ``git status`` on a scratch worktree.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATED = {"dvc.yaml"}

STAGE = '''"""A throwaway stage: writes reports/iter_k/hello.json (measures what adding a stage takes)."""
import json


def run(cfg, paths, **_):
    out = paths.reports / "hello.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"iteration": paths.iteration, "seed": cfg.pipeline.seed}))
    return {"wrote": str(out)}
'''
STAGE_ENTRY = '''    Stage("hello", "apprentice.stages.hello", params=("pipeline.seed",),
          io=lambda w: IO(deps=[w.paths.promotion], metrics=[NoCache(w.paths.reports / "hello.json")]),
          results=lambda p: [p.reports / "hello.json"]),
'''
FAMILY = '''"""A throwaway environment family: say the word (measures what adding a family takes)."""

from __future__ import annotations

from typing import ClassVar

from apprentice.envs import register
from apprentice.envs.base import DifficultyAxis, Environment, ProblemSpec, ToolCall, tool


@register
class EchoEnv(Environment):
    family: ClassVar[str] = "echo"
    axes: ClassVar[tuple[DifficultyAxis, ...]] = (DifficultyAxis("length", 1, 2),)
    system_prompt: ClassVar[str] = "Say the word."

    def build(self, spec: ProblemSpec) -> str:
        self.word = spec.rng().choice(["red", "blue", "green", "gold"])
        return f"Word: {self.word}"

    def oracle(self) -> list[ToolCall]:
        return [ToolCall("say", {"word": self.word})]

    def turn_budget(self) -> int:
        return 2

    @tool
    def say(self, word: str) -> str:
        """
        Say a word.

        Args:
            word: The word to say.
        """
        self.turns += 1
        if str(word).strip() == self.word:
            self.done, self.reward = True, 1.0
            return "Correct."
        return "Wrong."
'''
VARIANT = '''def sharp(cfg: Any) -> Recipe:
    """Vanilla OPD with its own GRPO group size (a throwaway variant with one knob)."""
    return _base(cfg, "sharp", samples_per_problem=cfg.distill.opd.sharp_samples)


'''
KNOB = '''    sharp_samples: int = Field(2, ge=1, description="sharp variant: episodes per problem per step.")
'''


def _insert(path: Path, anchor: str, text: str, after: bool = False) -> None:
    s = path.read_text()
    if anchor not in s:
        raise SystemExit(f"{path}: anchor {anchor!r} not found; update experiments/extension_cost.py to the new layout")
    i = s.index(anchor) + (len(anchor) if after else 0)
    path.write_text(s[:i] + text + s[i:])


def _run(argv: list[str], wt: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(wt), "DVC_NO_ANALYTICS": "1", "PREFECT_LOGGING_LEVEL": "ERROR"}
    r = subprocess.run(argv, cwd=wt, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"check failed in {wt}: {' '.join(argv)}\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return r.stdout


def add_stage(wt: Path) -> None:
    (wt / "apprentice/stages/hello.py").write_text(STAGE)
    _insert(wt / "apprentice/pipeline.py", '    Stage("evaluate-all"', STAGE_ENTRY)
    py = sys.executable
    _run([py, "-m", "apprentice.ops.dvcgen"], wt)
    _run([py, "-m", "apprentice", "hello", "--params", "params.yaml", "--root", str(wt / "_w"), "--iter", "1"], wt)
    _run([py, "-c", "import yaml; from tasks.stages import stage_task; from flows.self_improve import stage_order;"
          "assert 'hello-1' in yaml.safe_load(open('dvc.yaml'))['stages'];"
          "assert stage_task('hello').name == 'hello' and 'hello' in stage_order(1)"], wt)
    subprocess.run(["rm", "-rf", str(wt / "_w")], check=True)


def add_family(wt: Path) -> None:
    (wt / "apprentice/envs/echo.py").write_text(FAMILY)
    _run([sys.executable, "-m", "apprentice", "check-env", "echo"], wt)


def add_variant(wt: Path) -> None:
    _insert(wt / "apprentice/training/opd/variants.py", "#: ``opd`` is multi-turn", VARIANT)
    _insert(wt / "apprentice/training/opd/variants.py", '    "grpo": grpo,\n', '    "sharp": sharp,\n', after=True)
    _insert(wt / "apprentice/config.py", "\n\nclass DistillConfig", "\n" + KNOB.rstrip("\n"))
    _run([sys.executable, "-c", "from apprentice.config import load_config;"
          "from apprentice.training.opd.variants import recipe_for;"
          "cfg = load_config('params.yaml', overrides=['distill.variant=sharp', 'distill.opd.sharp_samples=3']);"
          "assert recipe_for(cfg).samples_per_problem == 3"], wt)


CASES: dict[str, Callable[[Path], None]] = {"(a) a stage": add_stage, "(b) an environment family": add_family,
                                            "(c) an OPD variant with one knob": add_variant}
TARGETS = {"(a) a stage": 2, "(b) an environment family": 1, "(c) an OPD variant with one knob": 2}


def touched(wt: Path) -> tuple[list[str], list[str]]:
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=wt, capture_output=True,
                         text=True, check=True).stdout
    files = sorted(line[3:] for line in out.splitlines())
    return [f for f in files if f not in GENERATED], [f for f in files if f in GENERATED]


def lines_added(wt: Path, files: list[str]) -> int:
    """The diff size of the hand-written files: lines added to tracked files plus new files' lines."""
    num = subprocess.run(["git", "diff", "--numstat", "--", *files], cwd=wt, capture_output=True, text=True,
                         check=True).stdout
    tracked = {line.split("\t")[2]: int(line.split("\t")[0]) for line in num.splitlines()}
    return sum(tracked.get(f, len((wt / f).read_text().splitlines())) for f in files)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default="HEAD", help="the commit to measure (default: HEAD)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wt = Path(tmp) / "wt"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(wt), args.ref], cwd=ROOT, check=True)
        try:
            print(f"{'extension':36s} {'hand-written files':>18s} {'target':>6s} {'lines':>6s}  generated   files")
            for name, add in CASES.items():
                add(wt)
                hand, gen = touched(wt)
                print(f"{name:36s} {len(hand):>18d} {'<= ' + str(TARGETS[name]):>6s} {lines_added(wt, hand):>6d}  "
                      f"{len(gen):>9d}   {', '.join(hand + [g + ' (generated)' for g in gen])}")
                subprocess.run(["git", "checkout", "-q", "."], cwd=wt, check=True)
                subprocess.run(["git", "clean", "-qfd"], cwd=wt, check=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(wt)], cwd=ROOT, check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
