"""``python -m apprentice <stage>``: one verb per stage, what dvc.yaml runs.

Each verb maps to ``apprentice.stages.<module>.run(cfg, paths) -> dict`` (a summary printed as
JSON). The CLI only parses arguments and loads the typed config; all logic lives in the stage.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

STAGES = {
    "prepare-base": "prepare_base",
    "synth": "synth",
    "rollout": "rollout",
    "teacher-rollout": "rollout",
    "validate": "validate",
    "sft": "sft",
    "rl": "rl",
    "distill": "distill",
    "evaluate": "evaluate",
    "evaluate-all": "evaluate_all",
    "promote": "promote",
    "report": "report",
    "evolve": "evolve",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m apprentice", description=__doc__.splitlines()[0])
    p.add_argument("stage", choices=sorted([*STAGES, "check-env"]),
                   help="stage to run (or check-env FAMILY: check an environment family against the protocol)")
    p.add_argument("family", nargs="?", default=None, help="(check-env) the environment family to check")
    p.add_argument("--levels", default="0,1,2", help="(check-env) levels to check, comma-separated")
    p.add_argument("--seeds", type=int, default=3, help="(check-env) seeds per level")
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    p.add_argument("--profile", default=None, help="profile to merge over the params (e.g. quick)")
    p.add_argument("--iter", type=int, default=1, dest="iteration", help="iteration number k (default 1)")
    p.add_argument("--root", default=".", help="project root holding data/ and models/")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one param, e.g. --set sft.max_steps=10 (repeatable)")
    p.add_argument("--policy", default=None, help="(rollout/evaluate) which model acts: oracle, base, sft, rl, student, or a path")
    p.add_argument("--out", default=None, help="(rollout/evaluate) output path override")
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = _parser().parse_args(argv)
    from apprentice.config import ConfigError, load_config
    from apprentice.paths import Paths

    try:
        cfg = load_config(args.params, args.profile, args.set)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.stage == "check-env":  # not a stage: nothing is written
        if not args.family:
            print("error: check-env needs a family, e.g. python -m apprentice check-env grid", file=sys.stderr)
            return 2
        from apprentice.envs.check import check_family

        levels = [int(x) for x in args.levels.split(",") if x.strip()]
        return 1 if check_family(args.family, levels, args.seeds) else 0
    paths = Paths(Path(args.root).resolve(), args.iteration)
    module = importlib.import_module(f"apprentice.stages.{STAGES[args.stage]}")
    extra = {k: v for k, v in (("policy", args.policy), ("out", args.out)) if v is not None}
    try:
        result = module.run(cfg, paths, **extra)
    except (FileNotFoundError, ValueError) as e:
        print(f"error in stage {args.stage}: {e}", file=sys.stderr)
        return 1
    if result is not None:
        print(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
