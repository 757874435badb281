"""Stage ``rollout`` (alias ``teacher-rollout``): the teacher plays every training problem.

Reads ``data/iter_k/problems.parquet``, builds the teacher from ``rollout.teacher`` (or
``--policy oracle|base|sft|rl|student|<path>``), runs ``rollout.samples_per_problem`` episodes per
problem with the batched engine and writes ``data/iter_k/teacher.parquet`` atomically.

Resumable: the output carries a fingerprint of what determines its episodes (problem specs, the
policy's model and sampling settings but not its URL, timeout or retries, model weights, seed, the
code, a plugin family's version and source) in its Parquet metadata; a rerun that finds a complete output with the same
fingerprint returns at once. The policy-resolution helpers here are shared with ``evaluate``.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from pathlib import Path
from typing import Any

import pandas as pd

from apprentice import codedeps, distributed, envs, shards
from apprentice.config import Config, PolicyConfig
from apprentice.evaluation import summarize
from apprentice.paths import Paths
from apprentice.progress import enabled  # APPRENTICE_QUIET=1: no bars
from apprentice.trajectories import read_parquet, write_parquet

MODEL_CHOICES = ("base", "sft", "rl", "student")
FINGERPRINT_KEY = "apprentice_fingerprint"


def model_dir(choice: str, cfg: Config, paths: Paths) -> str:
    """``base|sft|rl|student`` -> the model folder of this iteration; anything else is a path/HF id."""
    if choice == "base":
        from apprentice.modeling import resolve_model_ref

        return resolve_model_ref(cfg.model.base, paths.root)
    if choice in MODEL_CHOICES:
        p = paths.model_dir(choice)
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"{p} holds no model; run `python -m apprentice {choice if choice != 'student' else 'distill'}` first")
        return str(p)
    return choice


def resolve_policy(choice: str | None, default: PolicyConfig, cfg: Config, paths: Paths) -> tuple[str, PolicyConfig]:
    """``--policy`` value -> (short name for outputs, PolicyConfig). ``None`` keeps ``default``."""
    if choice is None:
        name = "oracle" if default.kind == "oracle" else _short(default.model or "base")
        if default.kind == "hf" and not default.model:
            default = default.model_copy(update={"model": model_dir("base", cfg, paths)})
        return name, default
    if choice == "oracle":
        return "oracle", default.model_copy(update={"kind": "oracle"})
    kind = "openai" if default.kind == "openai" and choice not in MODEL_CHOICES and not Path(choice).exists() else "hf"
    model = model_dir(choice, cfg, paths) if kind == "hf" else choice
    if kind == "hf" and choice == "base":  # a missing local base would surface as a hub connection error
        from apprentice.training.common import require_model

        require_model(model)
    name = choice if choice in MODEL_CHOICES else _short(choice)
    return name, default.model_copy(update={"kind": kind, "model": model})


def _short(ref: str) -> str:
    tail = Path(ref.rstrip("/")).name or "model"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", tail)


def build_policy(pol_cfg: PolicyConfig, cfg: Config, paths: Paths) -> Any:
    """The policy object via ``apprentice.policies.make_policy`` (model settings passed if it takes them)."""
    from apprentice.policies import make_policy

    if cfg.model.threads > 0:
        import torch

        torch.set_num_threads(cfg.model.threads)
    base = model_dir("base", cfg, paths)
    params = inspect.signature(make_policy).parameters
    extra: dict[str, Any] = {k: v for k, v in (("chat_template", cfg.model.chat_template), ("dtype", cfg.model.dtype),
                               ("seed", cfg.pipeline.seed), ("root", str(paths.root))) if k in params}
    pol = make_policy(pol_cfg, base, **extra)
    from apprentice.policies.hf import HFPolicy

    if isinstance(pol, HFPolicy):  # multi-turn rollouts: reuse each conversation's KV cache across turns
        from apprentice.policies.hf_cached import CachedHFPolicy

        pol = CachedHFPolicy.from_policy(pol)
    return pol


def model_fingerprint(ref: str) -> str:
    """Content hash of a local model folder's top-level files (weights, config, tokenizer), or the
    reference itself for a remote model. Hashing 0.5 GB takes ~1 s; far less than any rollout."""
    p = Path(ref)
    if not p.is_dir():
        return ref
    h = hashlib.sha256()
    for f in sorted(x for x in p.iterdir() if x.is_file() and not x.name.startswith(".")):
        h.update(f.name.encode())
        with f.open("rb") as fh:
            while block := fh.read(1 << 22):
                h.update(block)
    return h.hexdigest()


def fingerprint(problems: pd.DataFrame, pol_cfg: PolicyConfig, cfg: Config, **settings: Any) -> str:
    """What an episode table depends on: what determines an episode (problems, model, sampling, chat
    template, the code that plays it, a plugin family's package version and source hash), not how the
    answers were fetched (``PolicyConfig.TRANSPORT``: URL, key variable, timeout, retries), so a rerun
    with more retries or on another port resumes the finished shards. It is stored in the table (a DVC
    output), so it holds no absolute path: a local model is named by its folder and identified by its
    content."""
    policy = pol_cfg.episode_settings()
    if pol_cfg.kind == "hf" and Path(pol_cfg.model).is_dir():
        policy["model"] = Path(pol_cfg.model).name
    doc = {
        "specs": sorted(problems["spec"]),
        "policy": policy,
        "model": model_fingerprint(pol_cfg.model) if pol_cfg.kind == "hf" else "",
        "model_cfg": cfg.model.model_dump(exclude={"threads"}),
        "seed": cfg.pipeline.seed,
        # the code that plays the episodes (engine, policies, every environment) and library versions:
        # an edited environment must not leave a stale rollout behind (issue G)
        "code": codedeps.digest("apprentice.stages.rollout"),
        # a plugin family's code lives outside the project: its version and source hash (issue O)
        "plugins": envs.plugin_sources(problems["family"] if "family" in problems.columns else []),
        **settings,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def existing_if_complete(out: Path, fp: str, expected_rows: int) -> pd.DataFrame | None:
    """The output at ``out`` if it was written for exactly these inputs, else None."""
    if not out.exists():
        return None
    try:
        df = pd.read_parquet(out)
    except Exception:  # noqa: BLE001 - unreadable -> recompute
        return None
    if df.attrs.get(FINGERPRINT_KEY) != fp or len(df) != expected_rows:
        return None
    return df


def run(cfg: Config, paths: Paths, policy: str | None = None, out: str | None = None,
        progress: bool = True) -> dict[str, Any]:
    problems = read_parquet(paths.problems)
    target = Path(out) if out else paths.teacher_trajectories
    rc = cfg.rollout
    name, pol_cfg = resolve_policy(policy, rc.teacher, cfg, paths)
    fp = fingerprint(problems, pol_cfg, cfg, samples=rc.samples_per_problem, max_turns=rc.max_turns)
    n_rows = len(problems) * rc.samples_per_problem

    df = existing_if_complete(target, fp, n_rows)
    skipped = df is not None
    if df is None:
        shards.check_writable(target.parent)  # before any episode runs
        built: list[Any] = []  # local engine: one policy for every shard; ray: each actor builds its own

        def make_policy() -> Any:
            if not built:
                built.append(build_policy(pol_cfg, cfg, paths))
            return built[0]

        def chunk(rows: pd.DataFrame, seed: int) -> list[Any]:
            return distributed.run_episodes(rows, make_policy, engine=rc.engine, ray=cfg.ray,
                                            samples_per_problem=rc.samples_per_problem, max_turns=rc.max_turns,
                                            batch_size=pol_cfg.batch_size, progress=progress and enabled(), seed=seed)

        df, _ = shards.run_sharded(problems, chunk, target, fp, samples=rc.samples_per_problem, policy_id=name,
                                   shard_size=rc.shard_size, error_budget=rc.error_budget, seed=cfg.pipeline.seed)
        df.attrs[FINGERPRINT_KEY] = fp
        write_parquet(shards.without_wall_clock(df), target)
        shards.write_timings(target, df)
        shards.clear(target, fp, rc.shard_size)
    m = summarize(df)
    return {"out": str(target), "policy": name, "skipped": skipped, "episodes": len(df),
            "success_rate": m["success_rate"], "success_ci": [m["success_ci_low"], m["success_ci_high"]],
            "truncation_rate": m["truncation_rate"], "mean_turns": m["mean_turns"]}
