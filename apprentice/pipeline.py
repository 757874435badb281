"""The stage registry: every pipeline stage is declared once, here; everything else derives from it.

Why: a stage used to be described in eight places that had to agree by hand (the generator's
``ITERATION_STAGES``/``CODE``/``PARAMS``/``CURVES`` tables, the lineage tables of the Prefect tasks,
the flow's task list, the CLI's verbs, one task module per stage). Now a stage is its module
(``run(cfg, paths, **kw) -> dict``, in :mod:`apprentice.stages`) and one :class:`Stage` entry in
:data:`STAGES`. From the registry derive:

* the CLI verbs (``python -m apprentice <name>``, :mod:`apprentice.__main__`);
* ``dvc.yaml`` (:mod:`apprentice.ops.dvcgen`): command, code deps, params per key, data deps, outs,
  metrics and plots, one DVC stage per model for a per-model stage;
* the Prefect tasks (one factory, :func:`tasks.stage_task`, with the stage's retries) and the flow's
  stage order (:data:`STAGES` order: once-stages first, then one iteration's stages);
* which stages run at all under given params (:attr:`Stage.needed`): a stage whose outputs nothing
  reads is left out of ``dvc.yaml`` and the flow, and so are the deps on its outputs;
* what lineage records for a stage (:mod:`tasks._dvc`): result files whose numbers become run
  metrics, string keys that become tags, artifacts, the per-step training curve.

Every path comes from :class:`apprentice.paths.Paths`. An ``io`` function gets a :class:`Where`
whose ``paths`` are rooted at the work dir *relative to itself* (``Paths(Path(""), k)``), so the
same declaration renders ``dvc.yaml`` (``data/iter_1/problems.parquet``) and, rooted at the
absolute work dir, tells lineage which files to read.

Plain data and stdlib only: no Prefect, DVC, MLflow or torch import here, so the CLI, the generator
and the tasks all import it cheaply.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apprentice.paths import DVCLIVE_DIR, Paths

#: Retries of the stages that talk to a teacher/policy (network endpoints fail transiently).
ROLLOUT_RETRIES = int(os.environ.get("APPRENTICE_ROLLOUT_RETRIES", "2"))
#: Ends the CLI's error line when the error has ``retryable = False`` (a rejected API key, an endpoint
#: the circuit breaker gave up on): the Prefect task reads it in the stage's output and does not retry,
#: since a retry would only fail the same way, minutes later.
NOT_RETRYABLE = "[not retryable]"
#: Policies the evaluation scores on the benchmark, one DVC stage each (the table ``make run`` prints).
EVAL_POLICIES = ("base", "sft", "rl", "student")
#: Policies that do not change across iterations: scored once, in no iteration (``data/benchmark/eval``).
ONCE_POLICIES = ("base",)


@dataclass(frozen=True)
class NoCache:
    """A DVC out or metric kept beside the pipeline (``cache: false``), not in the DVC cache."""

    path: Path


PathLike = Path | NoCache


@dataclass(frozen=True)
class IO:
    """A stage's data deps, outputs and DVC metrics files (code deps come from its module)."""

    deps: Sequence[Path] = ()
    outs: Sequence[PathLike] = ()
    metrics: Sequence[PathLike] = ()


@dataclass(frozen=True)
class Where:
    """What an ``io`` function sees: iteration k's :class:`Paths` and the built base model, if any."""

    paths: Paths
    #: The base model folder as a dep: ``models/base`` when prepare-base builds it; empty when
    #: ``model.base`` names a hub id or a folder the user provides (then it is a param only).
    base: tuple[Path, ...] = ()
    #: The stages the params run (:func:`iteration_stages`): a stage declares a dep on another's
    #: outputs only when that one runs.
    stages: tuple[str, ...] = ()

    @property
    def prev(self) -> Paths | None:
        return self.paths.previous()

    def at(self, iteration: int) -> Paths:
        return Paths(self.paths.root, iteration)


def _none(_: Paths) -> list[Path]:
    return []


def _no_io(_: Where) -> IO:
    return IO()


@dataclass(frozen=True)
class Stage:
    """One pipeline stage. ``name`` is the CLI verb, the DVC stage prefix and the Prefect task name."""

    name: str
    #: dotted module with ``run(cfg, paths, **kw) -> dict`` (the CLI imports it only to run it)
    module: str
    #: params sections or single keys it reads (``dvc.yaml`` expands them to one entry per leaf key)
    params: tuple[str, ...] = ()
    #: params it reads only from iteration 2 on (the loop rule: iteration 1 trains the base model on its
    #: own validated set whatever the rule), so ``dvc exp run -S loop.rule=...`` keeps iteration 1 cached
    later_params: tuple[str, ...] = ()
    #: repo paths its code needs that imports cannot show (templates, suites, whole packages)
    code: tuple[str, ...] = ()
    io: Callable[[Where], IO] = _no_io
    #: False: runs once for all iterations (prepare-base, benchmark)
    per_iteration: bool = True
    #: one DVC stage per model (``--policy M``): DVC then reruns only the models that changed
    models: tuple[str, ...] = ()
    #: the extra deps and the outputs of model M's DVC stage
    model_io: Callable[[Where, str], IO] | None = None
    #: Prefect retries (with a 10 s delay)
    retries: int = 0
    #: JSON files whose flat numbers lineage logs as the stage run's metrics
    results: Callable[[Paths], list[Path]] = _none
    #: prefixes of string keys in the result files that lineage logs as tags
    tags: tuple[str, ...] = ()
    #: files lineage attaches to the stage run
    artifacts: Callable[[Paths], list[Path]] = _none
    #: a training stage's model folder name: its DVCLive folder holds the per-step curves (DVC plots, MLflow)
    curve: str | None = None
    #: builds environments, so it also runs the plugin modules params list (``envs.modules``)
    builds_envs: bool = False
    #: False: a CLI verb only, not a pipeline stage (e.g. ``evaluate-all``)
    in_pipeline: bool = True
    #: None: always in the pipeline. Else, given the merged params mapping: whether anything reads the
    #: stage's outputs under them; when nothing does, neither ``dvc.yaml`` nor the flow runs it (its CLI
    #: verb stays)
    needed: Callable[[Mapping[str, Any]], bool] | None = None
    aliases: tuple[str, ...] = field(default=())

    @property
    def module_path(self) -> str:
        """The module's file, relative to the repository (its first code dep)."""
        return self.module.replace(".", "/") + ".py"


# --- the stages' data flow (what dvc.yaml declares; what each stage reads and writes) -------------


def _frontier(w: Where) -> IO:
    # the champion the previous promotion names (path + md5 in the record) and the previous ceiling
    p, prev = w.paths, w.prev
    return IO(deps=[p.benchmark] + ([prev.promotion, prev.frontier_record] if prev else []),
              outs=[p.frontier_probe], metrics=[NoCache(p.frontier_record)])


def _frontier_on(params: Mapping[str, Any]) -> bool:
    """Whether the frontier stage runs: under ``frontier.mode: frontier`` (the default)."""
    return str((params.get("frontier") or {}).get("mode") or "frontier") == "frontier"


def _synth(w: Where) -> IO:
    p, prev = w.paths, w.prev
    return IO(deps=[p.benchmark] + ([prev.eval_dir, prev.promotion] if prev else [])
              + ([p.frontier_record, p.frontier_probe] if "frontier" in w.stages else []), outs=[p.problems])


def _evolve(w: Where) -> IO:
    # off-policy: generation 0 of iteration k is iteration k-1's last generation
    p, prev = w.paths, w.prev
    return IO(deps=[prev.evolve_dir] if prev else [], outs=[p.evolve_dir], metrics=[NoCache(p.evolve_record)])


def _rollout(w: Where) -> IO:
    return IO(deps=[w.paths.problems], outs=[w.paths.teacher_trajectories])


def _validate(w: Where) -> IO:
    p = w.paths
    return IO(deps=[p.problems, p.benchmark, p.teacher_trajectories], outs=[p.sft_data, NoCache(p.gate_html)],
              metrics=[NoCache(p.gate_record)])


def _loop_data(w: Where) -> IO:
    # the new validated set, every earlier one (replay, union) and, for k > 1, the champion the previous
    # promotion names (the self/repair rules roll it out; path + md5 in the record)
    p, prev, k = w.paths, w.prev, w.paths.iteration
    return IO(deps=[p.sft_data, p.problems, *(w.at(j).sft_data for j in range(1, k))]
              + ([prev.promotion] if prev else []),
              outs=[p.train_data, p.champion_rollouts], metrics=[NoCache(p.loop_record)])


def _sft(w: Where) -> IO:
    # iteration k > 1 starts from the champion the previous promotion names (path + md5), or from the
    # base model under loop.rule=restart (so the base folder is a dep in every iteration)
    p, prev = w.paths, w.prev
    return IO(deps=[p.train_data, *w.base] + ([prev.promotion] if prev else []),
              outs=[p.sft_model], metrics=[NoCache(p.sft_start)])


def _evolve_read(params: Mapping[str, Any]) -> bool:
    """Whether anything reads the evolve stage's generations: only RL's generation scheduler, while
    ``curriculum.evolve.feed`` > 0 (0, the class default, when the params omit it)."""
    evolve = (params.get("curriculum") or {}).get("evolve") or {}
    return int(evolve.get("feed") or 0) > 0


def _rl(w: Where) -> IO:
    # the evolved generations only while the evolve stage runs (its scheduler feeds them in)
    p = w.paths
    return IO(deps=[p.sft_model, p.problems, *([p.evolve_dir] if "evolve" in w.stages else []),
                    *([p.frontier_record] if "frontier" in w.stages else [])], outs=[p.rl_model])


def _distill(w: Where) -> IO:
    p = w.paths
    return IO(deps=[p.rl_model, p.sft_data, p.problems], outs=[p.student_model])


def _evaluate(w: Where) -> IO:
    return IO(deps=[w.paths.benchmark])


def _evaluate_model(w: Where, policy: str) -> IO:
    """deps = the benchmark (above) + that model's folder; outs = its parquet and metrics JSON."""
    model = list(w.base) if policy == "base" else [w.paths.model_dir(policy)]
    return IO(deps=model, outs=w.paths.eval_outputs(policy))


def _promote(w: Where) -> IO:
    p = w.paths
    return IO(deps=[p.eval_dir, p.benchmark_eval_dir], metrics=[NoCache(p.promotion)])


def _report(w: Where) -> IO:
    # index.html: the iteration's one-page report (gate exclusions from the teacher rows, the champion
    # trend from every earlier promotion); eval.md: every iteration's models on the benchmark
    p, k = w.paths, w.paths.iteration
    return IO(deps=[curve_dir(p, s) for s in curve_stages()] + [p.eval_dir, p.benchmark_eval_dir]
              + [w.at(j).eval_dir for j in range(1, k)] + [p.gate_record, p.teacher_trajectories]
              + [w.at(j).promotion for j in range(1, k + 1)],
              outs=[NoCache(p.curves_dir), NoCache(p.report_page)], metrics=[NoCache(p.drift_record)])


def _report_artifacts(p: Paths) -> list[Path]:
    # champion.png: the champion across iterations (the drift guard chart), also in MLflow
    return [p.report_page, p.curves_dir / "eval.md", p.drift_record, p.curves_dir / "champion.png"] + \
        [p.curves_dir / f"{s.name}.png" for s in curve_stages()]


# --- the registry: execution order (once-stages, then one iteration's stages) ----------------------

#: Every stage, in the flow's order. Adding a stage: its module in apprentice/stages/ + one entry here.
STAGES: tuple[Stage, ...] = (
    Stage("prepare-base", "apprentice.stages.prepare_base", params=("model", "pipeline.seed"),
          code=("apprentice/lm/modeling.py",), per_iteration=False),
    Stage("benchmark", "apprentice.stages.benchmark", params=("benchmark", "synth.families", "synth.levels"),
          code=("apprentice/envs", "apprentice/data/trajectories.py"), per_iteration=False, builds_envs=True,
          io=lambda w: IO(outs=[w.paths.benchmark], metrics=[NoCache(w.paths.benchmark_record)]),
          results=lambda p: [p.benchmark_record]),
    Stage("frontier", "apprentice.stages.frontier",
          params=("frontier", "synth.families", "synth.levels", "synth.n_train", "pipeline.seed", "model",
                  "evaluate.max_new_tokens", "evaluate.temperature", "evaluate.batch_size",
                  "evaluate.max_format_errors", "evaluate.max_repeats"),
          code=("apprentice/curriculum/frontier.py", "apprentice/curriculum/budget.py", "apprentice/stages/benchmark.py",
                "apprentice/envs",
                "apprentice/rollout/episodes.py", "apprentice/policies", "apprentice/templates"),
          io=_frontier, builds_envs=True, results=lambda p: [p.frontier_record], needed=_frontier_on),
    Stage("synth", "apprentice.stages.synth",
          params=("synth", "pipeline.seed", "promote.candidate", "frontier.mode",  # + the sampler settings synth.sampler uses
                  *(f"curriculum.{k}" for k in ("p_star", "band", "hard_threshold", "easy_threshold", "replay_share",
                                                "infeasible_share", "min_attempts", "seed"))),
          code=("apprentice/stages/benchmark.py", "apprentice/envs", "apprentice/data/trajectories.py",
                "apprentice/curriculum/difficulty.py", "apprentice/curriculum"),
          io=_synth, builds_envs=True),
    Stage("evolve", "apprentice.stages.evolve", params=("curriculum.evolve", "synth.families"),
          code=("apprentice/envs", "apprentice/data/trajectories.py"), io=_evolve, builds_envs=True,
          results=lambda p: [p.evolve_record], needed=_evolve_read),
    Stage("teacher-rollout", "apprentice.stages.rollout", params=("rollout", "pipeline.seed"),
          code=("apprentice/rollout/episodes.py", "apprentice/policies", "apprentice/envs", "apprentice/templates"),
          io=_rollout, retries=ROLLOUT_RETRIES, builds_envs=True, aliases=("rollout",)),
    Stage("validate", "apprentice.stages.validate", params=("validate",),
          code=("apprentice/gate", "expectations"), io=_validate, builds_envs=True,
          results=lambda p: [p.gate_record], artifacts=lambda p: [p.gate_html, p.gate_record]),
    Stage("loop-data", "apprentice.stages.loop_data",
          params=("pipeline.seed", "sft.learning_rate"),
          later_params=("loop", "model", "rollout.teacher", "rollout.max_turns",
                        "evaluate.max_new_tokens", "evaluate.batch_size", "evaluate.max_format_errors",
                        "validate.max_message_chars"),
          code=("apprentice/gate", "expectations", "apprentice/rollout/episodes.py", "apprentice/policies", "apprentice/envs",
                "apprentice/templates"),
          io=_loop_data, builds_envs=True, results=lambda p: [p.loop_record], tags=("rule", "start")),
    Stage("sft", "apprentice.stages.sft",
          params=("sft", "model", "pipeline.seed"), later_params=("loop.rule", "loop.lr_factor", "loop.warmup_steps", "loop.max_steps"),
          code=("apprentice/training", "apprentice/lm/modeling.py", "apprentice/templates", "apprentice/data/trajectories.py"),
          io=_sft, results=lambda p: [p.sft_start], tags=("start_model.",), curve="sft"),
    Stage("rl", "apprentice.stages.rl",
          params=("rl", "curriculum", "model", "pipeline.seed",  # + the probe's generation settings
                  "evaluate.max_new_tokens", "evaluate.batch_size", "evaluate.max_format_errors",
                  "curriculum.evolve.feed"),  # the generation scheduler's feed of evolved problems
          later_params=("loop.rule", "loop.lr_factor"),  # GRPO's rate scales as SFT's from iteration 2
          code=("apprentice/training", "apprentice/lm/modeling.py", "apprentice/rollout/episodes.py", "apprentice/envs",
                "apprentice/templates", "apprentice/curriculum"),
          io=_rl, builds_envs=True, curve="rl"),
    Stage("distill", "apprentice.stages.distill", params=("distill", "model", "pipeline.seed"),
          code=("apprentice/training", "apprentice/lm/modeling.py", "apprentice/templates"),
          io=_distill, builds_envs=True, curve="student"),
    Stage("evaluate", "apprentice.stages.evaluate", params=("evaluate", "model", "pipeline.seed"),
          code=("apprentice/rollout/shards.py", "apprentice/evaluation/metrics.py", "apprentice/rollout/episodes.py",
                "apprentice/policies", "apprentice/envs", "apprentice/templates"),
          io=_evaluate, models=EVAL_POLICIES, model_io=_evaluate_model, retries=ROLLOUT_RETRIES, builds_envs=True,
          results=lambda p: [p.eval_metrics(m) for m in EVAL_POLICIES]),
    Stage("promote", "apprentice.stages.promote", params=("promote", "model.base"),
          code=("apprentice/ops/lineage.py", "apprentice/evaluation/metrics.py", "apprentice/gate"), io=_promote,
          results=lambda p: [p.promotion], tags=("champion.",), artifacts=lambda p: [p.promotion]),
    Stage("report", "apprentice.stages.report", code=("apprentice/ops/report_html.py",), io=_report,
          artifacts=_report_artifacts, results=lambda p: [p.drift_record]),
    Stage("evaluate-all", "apprentice.stages.evaluate_all", in_pipeline=False),
)


def get(name: str) -> Stage:
    """The stage a CLI verb or pipeline name names (aliases included)."""
    for s in STAGES:
        if name == s.name or name in s.aliases:
            return s
    raise KeyError(f"unknown stage '{name}'; choose from {sorted(verbs())}")


def verbs() -> dict[str, Stage]:
    """Every CLI verb (stage names and their aliases) -> its stage."""
    return {v: s for s in STAGES for v in (s.name, *s.aliases)}


def _params(params: Any) -> Mapping[str, Any] | None:
    """The merged params mapping from a mapping or a typed config (its ``model_dump``), or None."""
    if params is None or isinstance(params, Mapping):
        return params
    return params.model_dump(by_alias=True)  # an apprentice.config.Config


def runs(stage: Stage, params: Any = None) -> bool:
    """Whether ``stage`` is in the pipeline under ``params`` (a params mapping or a Config; None: every
    stage the registry declares for the pipeline, whatever the params)."""
    if not stage.in_pipeline:
        return False
    mapping = _params(params)
    return stage.needed is None or mapping is None or stage.needed(mapping)


def once_stages(params: Any = None) -> list[str]:
    """Stages run once for all iterations (before iteration 1), in order; ``params`` as in :func:`runs`."""
    return [s.name for s in STAGES if not s.per_iteration and runs(s, params)]


def iteration_stages(params: Any = None) -> list[str]:
    """One iteration's stages, in execution order (the flow's order and dvc.yaml's). With ``params`` (the
    merged params mapping or a Config) only those the params run (:func:`runs`): the flow and the
    generator pass them; without, every per-iteration stage the registry declares."""
    return [s.name for s in STAGES if s.per_iteration and runs(s, params)]


def curve_dir(paths: Paths, stage: Stage) -> Path:
    """A training stage's DVCLive folder (``models/iter_k/<curve>/dvclive``): DVC plots and metrics,
    and MLflow's step metrics (:mod:`apprentice.training.curves`)."""
    assert stage.curve, f"stage {stage.name} trains no model"
    return paths.models / stage.curve / DVCLIVE_DIR


def curve_stages() -> list[Stage]:
    """Training stages whose DVCLive folder holds their curves (DVC plots + metrics, MLflow step metrics)."""
    return [s for s in STAGES if s.in_pipeline and s.curve]
