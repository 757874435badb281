"""Stage ``evaluate``: one policy on the fixed benchmark -> per-episode Parquet + DVC metrics JSON.

``--policy oracle|base|sft|rl|student|<path or HF id>``; by default the newest model of the
iteration (student, else rl, else sft, else base). The benchmark is the same in every iteration
(``stages.benchmark``), so the base model is scored once, into ``data/benchmark/eval/base.*``,
not once per iteration. Sampling settings come from ``evaluate``
(temperature, max_new_tokens, batch_size, samples_per_problem for pass@k), model settings from
``model`` (chat template, dtype). Writes ``data/iter_k/eval/<name>.parquet`` and ``<name>.json``
(flat metrics, see :func:`apprentice.evaluation.metrics.summarize`) and prints a table.

Resumable like ``rollout``: a complete episode table with the same input fingerprint is reused and
only the (cheap) metrics are recomputed.

Greedy evaluation of a model drafts from its parent's episodes on the same benchmark (:func:`draft_source`,
:meth:`apprentice.policies.hf_cached.CachedHFPolicy.add_drafts`): a turn the model would play as its
parent did costs a prefill instead of a decode. Drafts change what a turn costs, not what it is (a
draft is accepted only where the model's own argmax is it by a margin), so they are no DVC dependency;
where a parent's evaluation is missing the model is scored the same, without them. That holds where
the engine computes in fp32 (``evaluate.drafts: auto``); bf16 rounds a prefill and a decode step
differently, so there drafts run only when asked for (``true``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from apprentice.config import Config, PolicyConfig
from apprentice.data.trajectories import read_parquet, write_parquet
from apprentice.evaluation.metrics import format_table, summarize
from apprentice.infra import distributed
from apprentice.paths import Paths, atomic_path
from apprentice.policies.factory import MODEL_CHOICES, build_policy, resolve_policy
from apprentice.progress import enabled  # APPRENTICE_QUIET=1: no bars
from apprentice.rollout import shards


def newest_model(paths: Paths) -> str:
    """The most-trained model this iteration has produced so far."""
    for choice, p in (("student", paths.student_model), ("rl", paths.rl_model), ("sft", paths.sft_model)):
        if (p / "config.json").exists():
            return choice
    return "base"


def draft_source(cfg: Config, paths: Paths, name: str) -> Path | None:
    """The episodes of the model ``name`` was trained from, where already scored on the benchmark: RL
    from SFT, the student from its RL teacher (else SFT), SFT of iteration k > 1 from the champion
    promote-(k-1) named (the model it continues from, under the default loop rule; without that record,
    the previous iteration's ``promote.candidate``)."""
    parents = {"rl": [("sft", paths)], "student": [("rl", paths), ("sft", paths)]}
    prev = paths.previous()
    if prev is not None:
        parents["sft"] = [prev.recorded_champion() or (cfg.promote.candidate, prev)]
    for parent, where in parents.get(name, []):
        pq = where.eval_episodes(parent)
        if pq.exists():
            return pq
    return None


def run(cfg: Config, paths: Paths, policy: str | None = None, out: str | None = None,
        progress: bool = True) -> dict[str, Any]:
    problems = read_parquet(paths.eval_problems)
    ec = cfg.evaluate
    choice = policy or newest_model(paths)
    default = PolicyConfig.model_validate({"kind": "hf", "temperature": ec.temperature,
                                           "max_new_tokens": ec.max_new_tokens, "batch_size": ec.batch_size})
    if choice not in (*MODEL_CHOICES, "oracle") and cfg.rollout.teacher.kind == "openai":
        default = cfg.rollout.teacher.model_copy(update={"temperature": ec.temperature,
                                                         "max_new_tokens": ec.max_new_tokens})
    name, pol_cfg = resolve_policy(choice, default, cfg, paths)
    pq, js = paths.eval_outputs(name)
    if out:  # the same file names in a folder of the caller's
        pq, js = Path(out) / pq.name, Path(out) / js.name
    out_dir = pq.parent
    fp = shards.fingerprint(problems, pol_cfg, cfg, __name__, samples=ec.samples_per_problem, max_format_errors=ec.max_format_errors,
                            max_repeats=ec.repeat_stop)

    df = shards.existing_if_complete(pq, fp, len(problems) * ec.samples_per_problem)
    skipped = df is not None
    if df is None:
        shards.check_writable(out_dir)  # before any episode runs
        built: list[Any] = []  # local engine: one policy for every shard; ray: each actor builds its own
        source = draft_source(cfg, paths, name) if ec.temperature == 0 and ec.drafts is not False else None
        drafts = [] if source is None else [(json.loads(m), json.loads(t)) for m, t in
                                            read_parquet(source)[["messages", "tools"]].itertuples(index=False)]
        label = "" if source is None else paths.rel(source)

        def make_policy() -> Any:
            if not built:
                pol = build_policy(pol_cfg, cfg, paths)
                if drafts and callable(getattr(pol, "add_drafts", None)) and (
                        ec.drafts is True or getattr(pol, "drafts_exact", False)):
                    n = pol.add_drafts(drafts)
                    print(f"evaluate {name}: {n} draft turns from {label}", flush=True)
                built.append(pol)
            return built[0]

        def chunk(rows: Any, seed: int, **resume: Any) -> list[Any]:  # resume: run_sharded's journal
            return distributed.run_episodes(rows, make_policy, engine=cfg.rollout.engine, ray=cfg.ray, **resume,
                                samples_per_problem=ec.samples_per_problem,
                                batch_size=pol_cfg.batch_size, progress=progress and enabled(), seed=seed,
                                policy_id=name, max_format_errors=ec.max_format_errors,
                                max_repeats=ec.repeat_stop)

        df, _ = shards.run_sharded(problems, chunk, pq, fp, samples=ec.samples_per_problem, policy_id=name,
                                   shard_size=ec.shard_size, error_budget=ec.error_budget, seed=cfg.pipeline.seed)
        if built and callable(getattr(built[0], "stats_line", None)):
            print(f"evaluate {name}: engine {built[0].stats_line()}", flush=True)
        df.attrs[shards.FINGERPRINT_KEY] = fp
        write_parquet(shards.without_wall_clock(df), pq)
        shards.write_timings(pq, df)
        shards.clear(pq, fp, ec.shard_size)

    metrics = summarize(df, ec.pass_k)
    with atomic_path(js) as tmp:
        # a DVC metrics output: no wall-clock numbers (they are in <name>.timings.json)
        tmp.write_text(json.dumps({k: v for k, v in metrics.items() if "wall" not in k}, indent=2, sort_keys=True) + "\n")
    print(format_table(metrics, title=f"evaluate {name} on the benchmark ({len(problems)} problems, iteration {paths.iteration})"))
    return {"policy": name, "metrics": str(js), "episodes": str(pq), "skipped": skipped,
            "success_rate": metrics["success_rate"],
            "success_ci": [metrics["success_ci_low"], metrics["success_ci_high"]]}
