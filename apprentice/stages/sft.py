"""Stage ``sft``: fine-tune the start model on validated teacher trajectories -> ``models/iter_k/sft``.

Start model: iteration 1 starts from ``model.base``; iteration k > 1 from the registry **champion**
after promote-(k-1), read from ``reports/iter_{k-1}/promotion.json`` (its ``champion`` entry: the
model the registry calls best, or the base model while no candidate has beaten it). A challenger
that lost is never trained further. The loop rule (``loop.rule``, :mod:`apprentice.training.loop_rules`) decides
the rest: ``restart`` starts every iteration from the base model; the rules that continue from the
champion train at ``sft.learning_rate x loop.lr_factor`` with ``loop.warmup_steps`` of warm-up; every
rule trains ``loop.max_steps`` steps after iteration 1 (its set holds the replay too). The
data is the loop-data stage's ``data/iter_k/train.parquet`` (the validated set mixed by the rule). The record is a DVC dependency of this stage and names the
weights by md5, so ``dvc repro`` rebuilds the same chain without MLflow. The start model (path +
md5 + where it came from) is written to ``reports/iter_k/sft_start.json`` (DVC metrics; logged to
MLflow as tags). Rerunning with unchanged params and inputs is a no-op; an interrupted run resumes
from its last checkpoint (``models/iter_k/.work/sft``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from apprentice.config import Config
from apprentice.paths import Paths, atomic_path


def start_record(cfg: Config, paths: Paths) -> dict[str, Any]:
    """Where iteration k's SFT starts: ``{"path", "source", "version", "iteration", "md5"}``."""
    from apprentice.lm.modeling import resolve_model_ref
    from apprentice.stages.promote import champion_path, previous_champion, weights_md5
    from apprentice.training.loop_rules import starts_from_champion

    prev = paths.previous()
    if prev is None or not starts_from_champion(cfg.loop.rule, paths.iteration):
        ref = resolve_model_ref(cfg.model.base, paths.root)
        return {"path": ref, "source": "base" if prev is None else f"base (loop.rule={cfg.loop.rule})",
                "version": 0, "iteration": 0,
                "md5": weights_md5(Path(ref)) if Path(ref).is_dir() else ""}
    champ = previous_champion(paths, "starts from the champion")
    path = champion_path(champ, paths.root)
    source = "base" if champ.get("kind") == "base" else f"champion v{champ['version']}"
    return {"path": str(path), "source": source, "version": int(champ["version"]),
            "iteration": int(champ.get("iteration", 0)), "md5": champ.get("md5", "")}


def start_model(cfg: Config, paths: Paths) -> str:
    return start_record(cfg, paths)["path"]


def start_file(paths: Paths) -> Path:
    return paths.sft_start


def run(cfg: Config, paths: Paths, callbacks: list[Any] | None = None, **_: Any) -> dict[str, Any]:
    from apprentice.gate import require_passed
    from apprentice.lm.modeling import load_tokenizer
    from apprentice.training import common
    from apprentice.training.loop_rules import sft_schedule, sft_steps
    from apprentice.training.sft import train_sft

    require_passed(paths.sft_data, paths.gate_record)  # never train on data the gate did not pass
    common.setup_runtime(cfg)
    start = start_record(cfg, paths)
    base = start["path"]
    common.require_model(base)
    with atomic_path(start_file(paths)) as tmp:
        from apprentice.stages.promote import _rel

        tmp.write_text(json.dumps({"start_model": {**start, "path": _rel(Path(base), paths.root)}}, indent=1,
                                  sort_keys=True) + "\n")
    lr, warmup = sft_schedule(cfg.loop.rule, paths.iteration, cfg.sft.learning_rate, cfg.loop.lr_factor,
                              cfg.loop.warmup_steps, trained_start=start["version"] > 0)
    steps = sft_steps(paths.iteration, cfg.sft.max_steps, cfg.loop.max_steps)
    sft_cfg = cfg.sft.model_copy(update={"learning_rate": lr, "max_steps": steps})
    stamp = common.fingerprint({"sft": sft_cfg.model_dump(), "model": cfg.model.model_dump(), "warmup": warmup,
                                "start": _rel(Path(base), paths.root)},
                               [paths.train_data, Path(base)])
    if common.is_done(paths.sft_model, stamp):
        return {"model": str(paths.sft_model), "skipped": True, "reason": "outputs up to date"}
    records = train_records(paths)
    tok = load_tokenizer(base, cfg.model.chat_template)
    result = train_sft(base, tok, records, paths.sft_model, sft_cfg, dtype=cfg.model.dtype, stamp=stamp,
                       callbacks=callbacks or [], warmup_steps=warmup)
    return {"start_model": base, "start_model_md5": start["md5"], "start_source": start["source"],
            "learning_rate": lr, "warmup_steps": warmup, "max_steps": steps, **result}


def train_records(paths: Paths) -> list[dict[str, Any]]:
    """The loop-data stage's rows as TRL records; a row's ``context_turns`` (repair) travels along."""
    from apprentice.data.trajectories import read_parquet, to_sft_records
    from apprentice.training.loop_rules import CONTEXT

    if not paths.train_data.exists():
        raise FileNotFoundError(f"{paths.train_data} does not exist; run `python -m apprentice loop-data --iter "
                                f"{paths.iteration}` first (dvc repro does)")
    df = read_parquet(paths.train_data)
    records = to_sft_records(df)
    if CONTEXT in df.columns:
        for r, n in zip(records, df[CONTEXT].fillna(0).astype(int), strict=True):
            if n:
                r[CONTEXT] = int(n)
    return records
