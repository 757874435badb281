"""Stage ``distill``: teacher (this iteration's RL model, else its SFT model) -> student -> ``models/iter_k/student``.

1. build the student (``training.student``: layer-pruned teacher by default, or a given model);
2. warm start it with SFT on the teacher trajectories (``distill.student.warmup_steps`` at
   ``warmup_lr``): a layer-dropped SmolLM2 starts near the loss of a random model, ln(vocabulary
   size), and on-policy distillation of such a student teaches nothing (its samples are noise);
3. on-policy distillation with the variant named by ``distill.variant`` (``training.distill``).

Each phase resumes from its checkpoints (``models/iter_k/.work/student``); the warm-started student
is kept there until the distillation finishes, so a restart does not redo the warm start.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from apprentice.config import Config
from apprentice.paths import DVCLIVE_DIR, Paths


def teacher_path(paths: Paths) -> Path:
    for p in (paths.rl_model, paths.sft_model):
        if (p / "config.json").exists():
            return p
    raise FileNotFoundError(f"no teacher: neither {paths.rl_model} nor {paths.sft_model} exists; run "
                            "`python -m apprentice sft` (and `rl`) first")


def calibration_batches(tok: Any, records: list[dict[str, Any]], n: int = 8) -> list[Any]:
    """Token ids of the first ``n`` SFT conversations, one batch each: what block influence is measured on."""
    import torch

    out = []
    for r in records[:n]:
        ids = tok.apply_chat_template(r["messages"], tools=r.get("tools") or None, tokenize=True, return_dict=True)
        out.append(torch.tensor([ids["input_ids"]]))
    return out


def run(cfg: Config, paths: Paths, callbacks: list[Any] | None = None, **_: Any) -> dict[str, Any]:
    from apprentice.data.trajectories import read_parquet, to_sft_records
    from apprentice.lm.modeling import load_model, load_tokenizer
    from apprentice.training import common
    from apprentice.training.distill import problem_prompts, train_distill, trajectory_prompts
    from apprentice.training.sft import train_sft
    from apprentice.training.student import build_student, num_params

    common.setup_runtime(cfg)
    d = cfg.distill
    if d.student.warmup_steps > 0 or d.prompt_source in ("trajectories", "both"):
        from apprentice.gate import require_passed

        require_passed(paths.sft_data, paths.gate_record)  # the SFT set is trained on: the gate must have passed it
    teacher_dir = teacher_path(paths)
    inputs = [teacher_dir, paths.sft_data, paths.problems]
    stamp = common.fingerprint({"distill": d.model_dump(), "model": cfg.model.model_dump(),
                                "sft": cfg.sft.model_dump(), "teacher": teacher_dir.name}, inputs)
    if common.is_done(paths.student_model, stamp):
        return {"model": str(paths.student_model), "skipped": True, "reason": "outputs up to date"}

    tok = load_tokenizer(teacher_dir, cfg.model.chat_template)
    teacher = load_model(teacher_dir, dtype="fp32")
    work = common.work_dir_for(paths.student_model)
    warm_dir = work / "warm"
    result: dict[str, Any] = {"teacher": str(teacher_dir)}

    # 1-2. student + warm start (skipped when an earlier run finished it)
    if (warm_dir / common.STAMP_FILE).exists():
        student: Any = str(warm_dir)
        result["warmup"] = {"skipped": True, "reason": "warm-started student found in the work dir"}
    else:
        records = to_sft_records(read_parquet(paths.sft_data))
        student = build_student(teacher, d.student.source, d.student.keep_every, teacher_tokenizer=tok,
                                root=paths.root, prune=d.student.prune,
                                calibration=calibration_batches(tok, records) if d.student.prune == "influence" else None)
        result["kept_layers"] = list(getattr(student.config, "apprentice_kept_layers", []) or [])
        if d.student.warmup_steps > 0:
            warm_cfg = cfg.sft.model_copy(update={"max_steps": d.student.warmup_steps, "learning_rate": d.student.warmup_lr,
                                                  "deepspeed": "none", "lora": False, "seed": d.seed})
            result["warmup"] = train_sft(student, tok, records, warm_dir, warm_cfg, dtype=cfg.model.dtype,
                                         stamp={"phase": "warmup"}, stage="student_warmup")
            result["warmup"]["metrics"] = str(paths.student_model / common.METRICS_FILE)  # merged there
            student = str(warm_dir)
    common.release_memory()  # the warm start's trainer and optimizer: not under the distillation's peak
    student_model = load_model(student, dtype="fp32") if isinstance(student, str) else student
    result["student_params"] = num_params(student_model)
    result["teacher_params"] = num_params(teacher)
    result["param_ratio"] = round(result["student_params"] / result["teacher_params"], 4)

    # 3. on-policy distillation (student metrics file continues the warm start's log)
    metrics = work / common.METRICS_FILE
    if not metrics.exists() and (warm_dir / common.METRICS_FILE).exists():
        work.mkdir(parents=True, exist_ok=True)
        shutil.copy(warm_dir / common.METRICS_FILE, metrics)
    rows: list[dict[str, Any]] = []
    if d.prompt_source in ("problems", "both"):
        problems = read_parquet(paths.problems)
        if "split" in problems.columns:
            problems = problems[problems["split"] != "eval"]
        rows += problem_prompts(problems)
    if d.prompt_source in ("trajectories", "both"):
        rows += trajectory_prompts(read_parquet(paths.sft_data))
    info = {k: result[k] for k in ("student_params", "teacher_params", "param_ratio")}
    info["teacher"] = paths.rel(teacher_dir)  # relative: student.json is inside a DVC-tracked output
    if d.max_steps > 0:
        result.update(train_distill(student_model, teacher, tok, rows, paths.student_model, d, dtype=cfg.model.dtype,
                                    stamp=stamp, callbacks=callbacks or [], apprentice_cfg=cfg,
                                    extra_files={paths.student_record.name: json.dumps(info, indent=2)}))
    else:  # warm start only (e.g. to compare against SFT-only students)
        from apprentice.lm.modeling import save_model

        save_model(student_model, tok, paths.student_model)
        paths.student_record.write_text(json.dumps(info, indent=2))
        if metrics.exists():
            common.split_timings(metrics, paths.student_model / common.METRICS_FILE,
                                 common.timings_path(paths.student_model))
        if (warm_dir / DVCLIVE_DIR).is_dir():  # the warm start's DVCLive curves are the student's (dvc.yaml plots)
            shutil.copytree(warm_dir / DVCLIVE_DIR, paths.student_model / DVCLIVE_DIR)
        (paths.student_model / common.STAMP_FILE).write_text(json.dumps(stamp))
        shutil.rmtree(work, ignore_errors=True)
        result.update(model=str(paths.student_model), steps=0)
    return result
