"""Generate ``dvc.yaml`` from the params, so ``pipeline.iterations`` declares the iterations.

Why a generator and not DVC's own ``foreach``/``matrix`` templating: iteration k depends on
iteration k-1's outputs (the previous evaluation feeds environment evolution, the previous
promotion decision names the model SFT starts from). DVC interpolation cannot compute ``k-1`` and
iteration 1 has different deps from the others, so a ``foreach`` would need hand-kept parallel
lists in params. A 150-line generator keeps ``dvc.yaml`` plain (readable, diffable, ``dvc dag``
works) and a unit test fails when the committed file drifts from what the params declare.

Profiles. DVC must track the params the stages actually run with, so each profile is its own
DVC pipeline with its own fully merged params file:

* ``default``: the repository root (``dvc.yaml`` + the committed ``params.yaml``);
* any other profile P: the work dir ``runs/P/`` holding a generated ``params.yaml`` (``params.yaml``
  merged with ``apprentice/profiles/P.yaml``) and a generated ``dvc.yaml``; its data and models
  live under ``runs/P/data`` and ``runs/P/models``, so profiles never overwrite each other.

Every stage command is the same in every work dir (``python -m apprentice <stage> --params
params.yaml --root . --iter k``); code deps point back at the repository (``../../apprentice/...``).
Relative paths in params (``model.base``) resolve against the work dir.

``python -m apprentice.dvcgen [--profile P] [--check]`` writes (or checks) the files.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from apprentice.config import ConfigError, load_raw, read_yaml
from apprentice.curves import DVCLIVE_DIR
from apprentice.stages.evaluate_all import POLICIES

REPO = Path(__file__).resolve().parent.parent

#: Per-iteration stages, in execution order (also the Prefect flow's order).
ITERATION_STAGES = ["synth", "evolve", "teacher-rollout", "validate", "sft", "rl", "distill", "evaluate",
                    "promote", "report"]

#: Code each stage runs (relative to the repo); paths that do not exist yet are left out, so the
#: pipeline can be generated while modules land. Shared packages are listed whole: over-tracking
#: reruns a stage needlessly, under-tracking would silently keep a stale result. The first entry is
#: the stage's module: :func:`code_deps` adds every project module it imports (transitively), so
#: this table only needs what imports cannot show (templates, suites, DeepSpeed configs).
CODE: dict[str, list[str]] = {
    "prepare-base": ["apprentice/stages/prepare_base.py", "apprentice/modeling.py"],
    "benchmark": ["apprentice/stages/benchmark.py", "apprentice/envs", "apprentice/trajectories.py"],
    "synth": ["apprentice/stages/synth.py", "apprentice/stages/benchmark.py", "apprentice/envs", "apprentice/trajectories.py", "apprentice/difficulty.py",
              "apprentice/samplers.py", "apprentice/training/curriculum.py"],
    "evolve": ["apprentice/stages/evolve.py", "apprentice/envs", "apprentice/trajectories.py"],
    "teacher-rollout": ["apprentice/stages/rollout.py", "apprentice/rollout.py", "apprentice/policies",
                        "apprentice/envs", "apprentice/templates"],
    "validate": ["apprentice/stages/validate.py", "apprentice/gates.py", "expectations"],
    "sft": ["apprentice/stages/sft.py", "apprentice/training", "apprentice/modeling.py",
            "apprentice/templates", "apprentice/trajectories.py"],
    "rl": ["apprentice/stages/rl.py", "apprentice/training", "apprentice/modeling.py", "apprentice/rollout.py",
           "apprentice/envs", "apprentice/templates", "apprentice/samplers.py"],
    "distill": ["apprentice/stages/distill.py", "apprentice/training", "apprentice/modeling.py",
                "apprentice/templates"],
    "evaluate": ["apprentice/stages/evaluate.py", "apprentice/stages/rollout.py", "apprentice/evaluation.py",
                 "apprentice/rollout.py", "apprentice/policies", "apprentice/envs", "apprentice/templates"],
    "promote": ["apprentice/stages/promote.py", "apprentice/lineage.py", "apprentice/evaluation.py",
                "apprentice/gates.py"],
    "report": ["apprentice/stages/report.py", "apprentice/report_html.py"],
}

#: params sections (or single keys) each stage reads; expanded to one entry per leaf key.
PARAMS: dict[str, list[str]] = {
    "prepare-base": ["model", "pipeline.seed"],
    "benchmark": ["benchmark", "synth.families", "synth.levels"],
    "synth": ["synth", "pipeline.seed", "promote.candidate",  # + the sampler settings synth.sampler uses
              *(f"curriculum.{k}" for k in ("p_star", "band", "hard_threshold", "easy_threshold", "replay_share",
                                            "infeasible_share", "min_attempts", "seed"))],
    "evolve": ["curriculum.evolve"],
    "teacher-rollout": ["rollout", "pipeline.seed"],
    "validate": ["validate"],
    "sft": ["sft", "model", "pipeline.seed"],
    "rl": ["rl", "curriculum", "model", "pipeline.seed",  # + the probe's generation settings
           "evaluate.max_new_tokens", "evaluate.batch_size", "evaluate.max_format_errors",
           "curriculum.evolve.feed"],  # the generation scheduler's feed of evolved problems
    "distill": ["distill", "model", "pipeline.seed"],
    "evaluate": ["evaluate", "model", "pipeline.seed"],
    "promote": ["promote", "model.base"],
    "report": [],
}

#: Training stages whose DVCLive folder (``<model>/dvclive``) holds DVC plots + metrics: (stage, model dir name).
CURVES = [("sft", "sft"), ("rl", "rl"), ("distill", "student")]

#: ``model.base`` values that prepare-base builds (the embedded SmolLM2, the quick profile's tiny Llama).
BUILT_BASES = ("models/base", "models/tiny")

GENERATED_HEADER = "# GENERATED by `python -m apprentice.dvcgen` from {src}; do not edit by hand.\n"


def workdir(profile: str, repo: Path = REPO) -> Path:
    """Where profile ``profile``'s pipeline lives (the repo root for ``default``)."""
    return repo if profile in ("", "default") else repo / "runs" / profile


def stage_name(stage: str, iteration: int | None = None) -> str:
    return stage if iteration is None else f"{stage}-{iteration}"


def dvc_stages(stage: str, iteration: int | None = None) -> list[str]:
    """The DVC stages behind pipeline stage ``stage``: itself, except ``evaluate``, one per model.

    Why one DVC stage per evaluated model: DVC then re-evaluates only the models that changed. An RL
    experiment (``dvc exp run evaluate-rl-1 -S ...``) reruns RL and its own evaluation, not the base
    and SFT evaluations nor distillation; a distillation change re-evaluates only the student. The
    base model is scored on the fixed benchmark once (``evaluate-base``, no iteration): in later
    iterations that stage is a cache hit."""
    if stage == "evaluate" and iteration is not None:
        return [eval_stage(p, iteration) for p in EVAL_POLICIES]
    return [stage_name(stage, iteration)]


def eval_stage(policy: str, iteration: int) -> str:
    return "evaluate-base" if policy in ONCE_POLICIES else f"evaluate-{policy}-{iteration}"


def eval_outputs(policy: str, iteration: int) -> list[str]:
    """The files ``evaluate --policy policy`` writes (relative to the work dir); mirrors ``Paths.eval_dir_for``."""
    d = "data/benchmark/eval" if policy in ONCE_POLICIES else f"data/iter_{iteration}/eval"
    return [f"{d}/{policy}.parquet", f"{d}/{policy}.json"]


def _leaf_keys(raw: dict[str, Any], dotted: str) -> list[str]:
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return [dotted]  # absent from the file: DVC tracks it as missing, which is still a key
        node = node[part]
    if not isinstance(node, dict):
        return [dotted]
    out: list[str] = []
    for k in sorted(node):
        out.extend(_leaf_keys(raw, f"{dotted}.{k}"))
    return out


#: keys under a listed section that the stage does not read (environment evolution is its own stage).
EXCLUDE = ("curriculum.evolve",)


#: every stage that builds environments also runs the plugin modules params list (envs.modules)
ENV_STAGES = ("benchmark", "synth", "evolve", "teacher-rollout", "validate", "rl", "distill", "evaluate")


def _params(raw: dict[str, Any], stage: str) -> list[str]:
    extra = ["envs.modules"] if stage in ENV_STAGES and "envs" in raw else []
    keys = [k for entry in [*PARAMS[stage], *extra] for k in _leaf_keys(raw, entry)]
    keep = [k for k in keys if stage == "evolve" or k in PARAMS[stage] or not k.startswith(EXCLUDE)]
    return list(dict.fromkeys(keep))  # a key named on its own and inside its section: once


def _code(stage: str, prefix: str, repo: Path) -> list[str]:
    return [prefix + p for p in code_deps(stage, repo)]


#: Deps of every stage: the CLI that runs it, and the lock file (a changed TRL, transformers or torch
#: pin changes what every stage computes).
COMMON_DEPS = ["apprentice/__main__.py", "requirements.lock"]


def code_deps(stage: str, repo: Path = REPO) -> list[str]:
    """Repo-relative code deps of ``stage``: its own module first, the paths :data:`CODE` lists (data
    folders such as templates and suites), and the transitive import closure of the stage module and
    the CLI (:mod:`apprentice.codedeps`), so a module the stage imports can never be missing."""
    from apprentice.codedeps import deps

    own = CODE[stage][0]  # always listed: a missing module should fail loudly
    module = own.removesuffix(".py").replace("/", ".")
    derived = deps([module, "apprentice.__main__"], repo) if (repo / own).exists() else []
    listed = [p for p in [*CODE[stage][1:], *derived, *COMMON_DEPS] if (repo / p).exists()]
    covered = [p for p in listed if (repo / p).is_dir()]
    # a file inside a listed folder is already tracked by the folder
    listed = [p for p in listed if p in covered or not any(p.startswith(d + "/") for d in covered)]
    return [own, *dict.fromkeys(p for p in listed if p != own)]


#: Policies the ``evaluate`` stage scores on the benchmark (the table ``make run`` prints).
EVAL_POLICIES = list(POLICIES)
#: Policies that do not change across iterations: scored once (``data/benchmark/eval``).
ONCE_POLICIES = ("base",)
BENCHMARK = "data/benchmark/problems.parquet"


def _cmd(stage: str, iteration: int | None, extra: str = "") -> str:
    it = "" if iteration is None else f" --iter {iteration}"
    return f"python -m apprentice {stage}{extra} --params params.yaml --root .{it}"


def pipeline(raw: dict[str, Any], prefix: str = "", repo: Path = REPO) -> dict[str, Any]:
    """The ``dvc.yaml`` mapping for merged params ``raw``; ``prefix`` leads from the work dir to the repo."""
    n = int(raw.get("pipeline", {}).get("iterations", 1))
    # The embedded base is built by prepare-base (a DVC output); any other model.base (an HF id or a
    # folder the user provides) is only verified, so it is not an output and not a tracked dep.
    base = str(raw.get("model", {}).get("base", "models/base"))
    base_deps = [base] if base in BUILT_BASES else []
    stages: dict[str, Any] = {
        "prepare-base": {
            "cmd": _cmd("prepare-base", None),
            "deps": _code("prepare-base", prefix, repo),
            "params": _params(raw, "prepare-base"),
            **({"outs": base_deps} if base_deps else {}),
        }
    }
    stages["benchmark"] = {"cmd": _cmd("benchmark", None), "deps": _code("benchmark", prefix, repo),
                           "params": _params(raw, "benchmark"), "outs": [BENCHMARK],
                           "metrics": [{"data/benchmark/benchmark.json": {"cache": False}}]}
    metrics: list[str] = []
    plots: list[Any] = []
    for k in range(1, n + 1):
        d, m, r = f"data/iter_{k}", f"models/iter_{k}", f"reports/iter_{k}"
        prev = {"data": f"data/iter_{k - 1}", "reports": f"reports/iter_{k - 1}"} if k > 1 else None
        io: dict[str, dict[str, Any]] = {
            "synth": {"deps": [BENCHMARK] + ([f"{prev['data']}/eval"] if prev else []),
                      "outs": [f"{d}/problems.parquet"]},
            # off-policy: generation 0 of iteration k is iteration k-1's last generation
            "evolve": {"deps": [f"{prev['data']}/evolve"] if prev else [], "outs": [f"{d}/evolve"],
                       "metrics": [{f"{d}/evolve.json": {"cache": False}}]},
            "teacher-rollout": {"deps": [f"{d}/problems.parquet"], "outs": [f"{d}/teacher.parquet"]},
            "validate": {"deps": [f"{d}/problems.parquet", BENCHMARK, f"{d}/teacher.parquet"],
                         "outs": [f"{d}/sft.parquet", {f"{r}/gate.html": {"cache": False}}],
                         "metrics": [{f"{r}/gate.json": {"cache": False}}]},
            # iteration k > 1 starts from the champion the previous promotion names (path + md5)
            "sft": {"deps": [f"{d}/sft.parquet", *(base_deps if not prev else [])]
                    + ([f"{prev['reports']}/promotion.json"] if prev else []),
                    "outs": [f"{m}/sft"], "metrics": [{f"{r}/sft_start.json": {"cache": False}}]},
            "rl": {"deps": [f"{m}/sft", f"{d}/problems.parquet", f"{d}/evolve"], "outs": [f"{m}/rl"]},
            "distill": {"deps": [f"{m}/rl", f"{d}/sft.parquet", f"{d}/problems.parquet"], "outs": [f"{m}/student"]},
            # one DVC stage per model (dvc_stages): deps = the benchmark + that model's folder
            "evaluate": {"deps": [BENCHMARK], "outs": [],
                         "per_model": {"base": base_deps, "sft": [f"{m}/sft"], "rl": [f"{m}/rl"],
                                       "student": [f"{m}/student"]}},
            "promote": {"deps": [f"{d}/eval", "data/benchmark/eval"], "outs": [],
                        "metrics": [{f"{r}/promotion.json": {"cache": False}}]},
            # index.html: the iteration's one-page report (gate exclusions from the teacher rows,
            # the champion trend from every earlier promotion); eval.md: every iteration's models on the benchmark
            "report": {"deps": [f"{m}/{out}/{DVCLIVE_DIR}" for _, out in CURVES] + [f"{d}/eval", "data/benchmark/eval"]
                       + [f"data/iter_{j}/eval" for j in range(1, k)]
                       + [f"{r}/gate.json", f"{d}/teacher.parquet"]
                       + [f"reports/iter_{j}/promotion.json" for j in range(1, k + 1)],
                       "outs": [{f"{r}/curves": {"cache": False}}, {f"{r}/index.html": {"cache": False}}]},
        }
        for stage in ITERATION_STAGES:
            spec: dict[str, Any] = {"cmd": _cmd(stage, k), "deps": _code(stage, prefix, repo) + io[stage]["deps"]}
            if ps := _params(raw, stage):
                spec["params"] = ps
            if io[stage]["outs"]:
                spec["outs"] = io[stage]["outs"]
            if "metrics" in io[stage]:
                spec["metrics"] = io[stage]["metrics"]
            if stage != "evaluate":
                stages[stage_name(stage, k)] = spec
                continue
            for policy, name in zip(EVAL_POLICIES, dvc_stages(stage, k), strict=True):
                if name in stages:  # evaluate-base: declared by iteration 1, shared by all
                    continue
                stages[name] = {**spec, "params": list(spec.get("params", [])),  # a copy: no YAML anchors
                                "cmd": _cmd(stage, None if policy in ONCE_POLICIES else k, f" --policy {policy}"),
                                "deps": spec["deps"] + io[stage]["per_model"][policy],
                                "outs": eval_outputs(policy, k)}
        metrics.extend(out for p in EVAL_POLICIES for out in eval_outputs(p, k)[1:] if out not in metrics)
        # the training curves: each stage's DVCLive folder as DVCLive declares it itself (every
        # plots/metrics/<name>.tsv against step), and its metrics.json for `dvc exp show` / `dvc metrics`
        plots.extend({f"{m}/{out}/{DVCLIVE_DIR}/plots/metrics": {"x": "step"}} for _, out in CURVES)
        metrics.extend(f"{m}/{out}/{DVCLIVE_DIR}/metrics.json" for _, out in CURVES)
    return {"stages": stages, "metrics": metrics, "plots": plots}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def render(raw: dict[str, Any], source: str, prefix: str = "", repo: Path = REPO) -> str:
    body = yaml.safe_dump(pipeline(raw, prefix, repo), sort_keys=False, width=120)
    return GENERATED_HEADER.format(src=source) + body


def write(profile: str = "default", repo: Path = REPO, check: bool = False) -> Path:
    """Write (or with ``check`` compare) the profile's ``dvc.yaml`` (+ merged params); return the work dir.

    Raises :class:`RuntimeError` in check mode when a committed file is out of date.
    """
    wd = workdir(profile, repo)
    base = repo / "params.yaml"
    raw = load_raw(base)
    if wd != repo:  # the profile file of the repo being run (a test project may carry its own)
        pfile = repo / "apprentice" / "profiles" / f"{profile}.yaml"
        if not pfile.exists():
            known = sorted(p.stem for p in pfile.parent.glob("*.yaml"))
            raise ConfigError(f"unknown profile '{profile}'; choose from {['default', *known]}")
        raw = _merge(raw, read_yaml(pfile) or {})
        raw.setdefault("pipeline", {})["profile"] = profile
    files: dict[Path, str] = {}
    if wd != repo:
        src = f"params.yaml + apprentice/profiles/{profile}.yaml"
        files[wd / "params.yaml"] = GENERATED_HEADER.format(src=src) + yaml.safe_dump(raw, sort_keys=False)
    else:
        src = "params.yaml"
    prefix = os.path.relpath(repo, wd) + "/" if wd != repo else ""
    files[wd / "dvc.yaml"] = render(raw, src, prefix, repo)
    for path, text in files.items():
        current = path.read_text() if path.exists() else None
        if current == text:
            continue
        if check:
            raise RuntimeError(f"{path} is out of date with the params; regenerate it with "
                               f"`python -m apprentice.dvcgen --profile {profile}` and commit it")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return wd


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m apprentice.dvcgen", description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="default")
    p.add_argument("--check", action="store_true", help="fail if the files on disk differ from the params")
    args = p.parse_args(argv)
    try:
        wd = write(args.profile, check=args.check)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(wd / "dvc.yaml")
    return 0


if __name__ == "__main__":
    sys.exit(main())
