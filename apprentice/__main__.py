"""``python -m apprentice <stage>``: one verb per stage, what dvc.yaml runs.

The verbs are the stage registry's (:mod:`apprentice.pipeline`, names and aliases); each maps to its
stage module's ``run(cfg, paths) -> dict`` (a summary printed as JSON). The CLI only parses
arguments and loads the typed config; all logic lives in the stage.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import warnings
from pathlib import Path

# TRL 1.16 asks the model for `is_gradient_checkpointing` every step; transformers 5.24 warns it is renamed. Not ours
# to fix, and one warning per stage on a normal run is noise (pinned versions: tests/unit/test_library_contracts.py).
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m apprentice", description=__doc__.splitlines()[0])
    from apprentice.pipeline import verbs

    p.add_argument("stage", choices=sorted([*verbs(), "check-env"]),
                   help="stage to run (or check-env FAMILY: check an environment family against the protocol)")
    p.add_argument("family", nargs="?", default=None, help="(check-env) the environment family to check")
    p.add_argument("--levels", default="", help="(check-env) levels to check, comma-separated "
                   "(default: levels 0-7, or 0 to the family's top level when it has fewer)")
    p.add_argument("--seeds", type=int, default=3, help="(check-env) seeds per level")
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    p.add_argument("--profile", default=None, help="profile to merge over the params (e.g. quick)")
    p.add_argument("--iter", type=int, default=1, dest="iteration", help="iteration number k (default 1)")
    p.add_argument("--root", default=".", help="project root holding data/ and models/")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one param, e.g. --set sft.max_steps=10 (repeatable)")
    p.add_argument("--policy", default=None, help="(rollout/evaluate) which model acts: oracle, base, sft, rl, student, or a path")
    p.add_argument("--out", default=None, help="(rollout/evaluate) output path override")
    p.add_argument("--debug", action="store_true", help="on an error, print the full traceback, not one line")
    return p


#: (exception class name or message fragment, what to do): the second half of a one-line error.
_HINTS = (
    ("SafetensorError", "a weights file is truncated or corrupt: rerun the stage that wrote that model folder "
                        "(delete the folder first), or `dvc checkout` it"),
    ("incomplete metadata", "a weights file is truncated: rerun the stage that wrote it, or `dvc checkout` it"),
    ("couldn't connect to 'https://huggingface.co'", "the model is not on this machine and downloads are off "
                                                     "(HF_HUB_OFFLINE=1): point the params at a local model folder "
                                                     "or run the stage that produces it"),
    ("ConnectError", "the endpoint is not reachable: start the server or fix its base_url in the params"),
    ("ConnectTimeout", "the endpoint did not answer: check that the server is up and its base_url"),
    ("HTTPStatusError", "the endpoint refused the request: check the model name, the API key variable and the URL"),
    ("APIConnectionError", "the endpoint is not reachable: start the server or fix rollout.teacher.base_url"),
    ("APIStatusError", "the endpoint refused the request: check rollout.teacher.model and the API key variable"),
    ("PermissionError", "a path is not writable: fix its permissions or choose another --root/--out"),
)


def describe(exc: BaseException) -> str:
    """One line: what failed (exception and its message, first lines only) and, when known, the fix."""
    chain = [exc]
    while chain[-1].__cause__ is not None and len(chain) < 5:
        chain.append(chain[-1].__cause__)
    if type(exc).__module__.startswith("apprentice") or type(exc) in (ValueError, FileNotFoundError):
        return str(exc)  # ours: written to name the key/file and the fix (a gate failure lists its checks)
    text = " ".join(str(exc).split())
    if len(text) > 400:
        text = text[:400] + " ..."
    names = " ".join(f"{type(e).__name__} {e}" for e in chain)
    hint = next((fix for key, fix in _HINTS if key in names), "")
    return f"{type(exc).__name__}: {text}" + (f" -> {hint}" if hint else "") + " (rerun with --debug for the traceback)"


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from apprentice.progress import apply_quiet

    apply_quiet()  # APPRENTICE_QUIET=1: no progress bars (CI logs)
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
        if not levels:  # the levels the frontier controller plans in a run of a few iterations
            from apprentice.envs import resolve

            try:
                levels = list(range(min(resolve(args.family).top_level(), 7) + 1))
            except (KeyError, ValueError) as e:  # an unknown family: check_family names it and the fix
                print(f"error: {e}", file=sys.stderr)
                return 2
        return 1 if check_family(args.family, levels, args.seeds) else 0
    paths = Paths(Path(args.root).resolve(), args.iteration)
    from apprentice.pipeline import get

    module = importlib.import_module(get(args.stage).module)
    extra = {k: v for k, v in (("policy", args.policy), ("out", args.out)) if v is not None}
    t0 = time.perf_counter()
    try:
        result = module.run(cfg, paths, **extra)
    except Exception as e:  # noqa: BLE001 - one clear line for an operator; --debug shows the traceback
        if args.debug:
            raise
        from apprentice.pipeline import NOT_RETRYABLE

        mark = f" {NOT_RETRYABLE}" if getattr(e, "retryable", True) is False else ""
        print(f"error in stage {args.stage}: {describe(e)}{mark}", file=sys.stderr)
        return 1
    if result is not None:
        print(json.dumps(result, indent=2, default=str))
    record_resources(paths.root, args.stage, args.iteration, args.policy, time.perf_counter() - t0)
    return 0


def record_resources(root: Path, stage: str, iteration: int, policy: str | None, wall_s: float) -> dict:
    """Print and append (``reports/resources.jsonl``) the stage's wall time and peak resident memory.

    Peak RSS is the process's own high-water mark (``getrusage``), i.e. what ``/usr/bin/time -v``
    reports for the stage. The file is not a DVC output (timings differ run to run); the flow reads
    it to print the per-stage table at the end of ``make run``.

    ``torch_threads`` (stages that loaded torch): the intra-op thread count the stage computed with.
    It is part of what makes a run reproducible: the thread count changes the order of floating-point
    reductions, so greedy evaluation of the same model with 1 and 2 threads does not give identical
    transcripts for every problem (docs/operations.md, "Same dtype, same thread count")."""
    import resource

    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2  # KiB on Linux
    name = f"{stage}{'-' + policy if policy else ''}"
    rec = {"stage": name, "iteration": iteration, "wall_s": round(wall_s, 1), "peak_rss_gb": round(peak_gb, 2),
           "flow_run": os.environ.get("APPRENTICE_FLOW_RUN", ""), "time": round(time.time(), 1)}
    if "torch" in sys.modules:  # never imported here only to ask: the import costs seconds
        rec["torch_threads"] = sys.modules["torch"].get_num_threads()
    print(f"resources: {name} (iteration {iteration}) {wall_s:.1f} s, peak RSS {peak_gb:.2f} GB", file=sys.stderr)
    try:
        from apprentice.paths import Paths

        log = Paths(Path(root)).resources_log
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as f:
            f.write(json.dumps(rec) + "\n")
    except OSError:  # a read-only root must not fail a finished stage
        pass
    return rec


if __name__ == "__main__":
    sys.exit(main())
