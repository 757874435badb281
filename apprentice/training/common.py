"""What every training stage shares: TRL arguments for CPU/GPU, per-step metrics, resume, finalize.

Why these helpers exist (TRL does the training; these only fill the gaps between TRL and a pipeline):
  * TRL's defaults are tuned for GPUs. On CPU ``bf16=True`` (its default) raises unless
    ``use_cpu=True``, and ``gradient_checkpointing=True`` (its default) recomputes activations to
    save memory that a model of our size on CPU does not need. :func:`trl_args` builds any TRL
    config class from our typed params with the right device settings, so the three stages cannot
    drift apart.
  * bf16 on CPU is autocast, and accelerate applies it by wrapping ``model.forward`` (the Trainer
    leaves it to accelerate). A loss that calls the backbone directly (our SFT head on loss
    positions, TRL's distillation loss through ``_forward_redirection``) skips that wrapper and
    silently trains in fp32: those two enter ``self.accelerator.autocast()`` themselves
    (``tests/integration/test_dtypes.py`` asserts every trainer's forward precision).
  * TRL reports metrics to trackers (wandb, MLflow...) but the pipeline wants a plain JSONL file beside
    each stage's outputs (plots, DVC, and ``apprentice.ops.lineage`` read it): :class:`MetricsCallback`.
  * Resume = "find the last ``checkpoint-*`` in the stage's work dir and pass it to ``train``"
    (:func:`last_checkpoint`); the work dir survives a crash and is deleted after success.
  * Finalize = fix ``use_cache`` (SFTTrainer leaves ``use_cache: false`` in config.json, and a
    student built from it would generate without a KV cache, many times slower), merge LoRA, write
    model + tokenizer into the final folder atomically (rename when complete), copy the metrics (and
    DVCLive's folder) in.
  * A stamp (``apprentice_stage.json``) in the final folder records a fingerprint of the stage's
    params and inputs, so rerunning a finished stage with the same inputs is a no-op.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from apprentice.lm.modeling import fix_generation_config, resolve_dtype
from apprentice.paths import DVCLIVE_DIR, atomic_path

METRICS_FILE = "metrics.jsonl"
STAMP_FILE = "apprentice_stage.json"
DEEPSPEED_DIR = Path(__file__).resolve().parents[1] / "infra" / "deepspeed"

# TRL log keys -> the pipeline's names (the raw keys are kept as well).
_KEY_ALIASES = {"reward": "reward", "kl": "kl", "loss": "loss", "learning_rate": "learning_rate"}
#: Counters TRL keeps in the trainer object (not in the checkpoint): they restart at 0 on a resume.
CUMULATIVE_KEYS = ("num_tokens",)


# ---- device ---------------------------------------------------------------------------------------
def on_gpu() -> bool:
    return torch.cuda.is_available()


def use_bf16(dtype: str = "auto") -> bool:
    """Whether to train with bf16 (autocast on CPU, mixed precision on GPU): modeling's dtype policy."""
    return resolve_dtype(dtype) == torch.bfloat16


def setup_runtime(cfg: Any) -> None:
    """Process-wide settings every training stage applies first: torch threads, seeds."""
    from transformers import set_seed

    if cfg.model.threads > 0:
        torch.set_num_threads(cfg.model.threads)
    set_seed(cfg.pipeline.seed)


def release_memory() -> None:
    """Hand memory freed by a finished training phase back to the OS before the next one starts.

    Why: a finished ``Trainer`` (its optimizer state, gradients, activations' arenas) sits in reference
    cycles until a collection, and glibc keeps freed arena pages mapped, so the process's RSS stays at
    the phase's high-water mark and the next phase stacks on top (distill: the student's warm start,
    then on-policy distillation). ``malloc_trim`` is glibc's; elsewhere only the collection runs.
    """
    import gc

    from apprentice.lm.modeling import trim_heap

    gc.collect()
    trim_heap()  # not glibc (macOS, musl): the collection alone


def require_model(ref: str) -> None:
    """Fail early, with the fix, when a local model folder a stage needs is missing."""
    p = Path(ref)
    looks_local = p.is_absolute() or p.parts[:1] in (("models",), (".",), ("..",)) or len(p.parts) != 2
    if looks_local and not (p / "config.json").exists():
        raise FileNotFoundError(
            f"model folder {ref} does not exist (no config.json); run the stage that produces it first "
            "(`python -m apprentice prepare-base` for model.base) or point the params at an HF folder/id"
        )


def trl_args(config_cls: type, output_dir: Path, *, dtype: str, max_steps: int, batch_size: int,
             learning_rate: float, save_steps: int, seed: int, grad_accum: int = 1,
             deepspeed: str | None = None, **extra: Any) -> Any:
    """A TRL ``*Config`` (SFTConfig, GRPOConfig, DistillationConfig) with the pipeline's device settings.

    ``extra`` goes straight to the config class, so stage-specific TRL fields stay in the stage.
    """
    bf16 = use_bf16(dtype)
    kw: dict[str, Any] = dict(
        output_dir=str(output_dir),
        max_steps=max_steps,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=grad_accum,
        learning_rate=learning_rate,
        bf16=bf16,
        fp16=False,
        use_cpu=not on_gpu(),
        activation_checkpointing=on_gpu(),  # costs time and buys nothing at our sizes on CPU
        report_to="none",
        logging_steps=1,
        save_strategy="steps",
        save_steps=save_steps,
        save_total_limit=1,  # a checkpoint with AdamW state is several times the model's size
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
        disable_tqdm=False,
    )
    if deepspeed:
        kw["deepspeed"] = deepspeed
    kw.update(extra)
    return config_cls(**kw)


def deepspeed_config(stage: str) -> str | None:
    """Path of the DeepSpeed JSON for ``stage`` ('none' | 'zero2' | 'zero3'), preparing a 1-process launch.

    DeepSpeed (through accelerate) reads the torch.distributed rendezvous from the environment; a
    plain ``python -m apprentice sft`` has none, so set the single-process values unless a launcher
    (``deepspeed``/``torchrun``/``accelerate launch``) already did.
    """
    if stage == "none":
        return None
    path = DEEPSPEED_DIR / f"{stage}.json"
    if not path.exists():
        raise ValueError(f"unknown DeepSpeed setting '{stage}'; use none, zero2 or zero3 (files in {DEEPSPEED_DIR})")
    if stage == "zero3" and not on_gpu():
        raise ValueError("DeepSpeed ZeRO-3 needs a GPU; on CPU set sft.deepspeed=zero2 or none")
    if "RANK" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", str(_free_port())),
                          RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if not on_gpu() and os.environ.get("WORLD_SIZE") == "1":
        # On CPU DeepSpeed JIT-compiles its shared-memory all-reduce op (C++, minutes on a small CPU,
        # and a stale lock after an interrupted build blocks every later run) when it creates the
        # process group. One process never communicates, so mark the op unavailable: DeepSpeed then
        # falls back to torch.distributed (gloo), which is what it uses for the op-less path anyway.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return str(path)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def release_distributed() -> None:
    """Tear down a process group DeepSpeed created, so a later trainer in the same process starts clean."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    try:
        from accelerate.state import AcceleratorState, PartialState

        AcceleratorState._reset_state(reset_partial_state=True)
        PartialState._reset_state()
    except Exception:  # accelerate internals moved: harmless, only matters for in-process reuse
        pass


# ---- metrics --------------------------------------------------------------------------------------
class MetricsCallback(TrainerCallback):
    """Append one JSON line per logging step: step, time, loss, reward, kl, learning_rate + TRL's keys.

    The file is appended to, so a resumed run continues the same log (its steps continue from the
    checkpoint's step, which the resume test checks). The trainer restarts its own counters on a
    resume (TRL's ``num_tokens``, the elapsed time, the loss sum behind the final ``train_loss``);
    this callback continues them from the rows already in the file (``trim_metrics`` has cut those
    to the checkpoint's step), so a resumed run logs the same numbers as an uninterrupted one.
    """

    def __init__(self, path: Path, stage: str) -> None:
        self.path = Path(path)
        self.stage = stage
        self.t0 = time.time()
        before = [r for r in read_metrics(self.path) if r.get("stage") == stage]
        last = before[-1] if before else {}
        self.time_offset = float(last.get("time", 0.0))
        self.counter_offsets = {k: float(last[k]) for k in CUMULATIVE_KEYS if k in last}
        self.loss_sum, self.loss_steps = 0.0, 0
        self.last_step = int(last.get("step", 0))  # where this run continues (after trim_metrics)
        self.last_row: dict[str, Any] = {}  # the row on_log wrote last: what loggers.DVCLiveLogger logs
        for r in before:
            if "loss" in r:
                self.loss_sum += r["loss"]
                self.loss_steps += 1

    @property
    def train_loss(self) -> float | None:
        """Mean per-step loss over the whole run (both sides of any resume): what HF's ``train_loss`` is
        for an uninterrupted run (it sums the same per-step losses in the same order)."""
        return self.loss_sum / self.loss_steps if self.loss_steps else None

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001 (TRL signature)
        if not logs or not state.is_world_process_zero:
            return
        row: dict[str, Any] = {"stage": self.stage, "step": int(state.global_step),
                               "time": round(self.time_offset + time.time() - self.t0, 3)}
        for k, v in logs.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                row[k] = float(v)
        for k, off in self.counter_offsets.items():
            if k in row:
                row[k] += off
        if "loss" in logs:
            self.loss_sum += logs["loss"]
            self.loss_steps += 1
        if "train_loss" in row and self.train_loss is not None:
            row["train_loss"] = self.train_loss
        for k, alias in _KEY_ALIASES.items():
            if k in row:
                row[alias] = row[k]
        self.last_row = row
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()


def summary_train_loss(metrics: Path, stage: str, fallback: float) -> float:
    """The run's ``train_loss`` from its metrics file (correct across resumes; see MetricsCallback)."""
    rows = [r for r in read_metrics(metrics) if r.get("stage") == stage and "train_loss" in r]
    return float(rows[-1]["train_loss"]) if rows else float(fallback)


def trim_metrics(path: Path, stage: str, upto_step: int) -> None:
    """Drop ``stage``'s rows logged after ``upto_step``: a run that died after its last checkpoint
    logged steps the resumed (or restarted, ``upto_step=0``) run will log again. Also drops a line
    a kill cut in half."""
    path = Path(path)
    if not path.exists():
        return
    rows = read_metrics(path)
    keep = [r for r in rows if r.get("stage") != stage or r.get("step", 0) <= upto_step]
    text = "".join(json.dumps(r) + "\n" for r in keep)
    if text != path.read_text():
        with atomic_path(path) as tmp:
            tmp.write_text(text)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics JSONL file; a line cut short by a kill is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


# ---- resume / finalize ----------------------------------------------------------------------------
def last_checkpoint(work_dir: Path) -> str | None:
    """The newest *complete* ``checkpoint-N`` in ``work_dir`` (what ``trainer.train(resume_from_checkpoint=)`` takes).

    A kill or a full disk during a save leaves ``checkpoint-N`` half written (a 0-byte
    ``optimizer.pt``, no ``trainer_state.json``) and HF's own ``get_last_checkpoint`` would return it
    forever. Each candidate is checked (:func:`checkpoint_problem`), newest first; a broken one is moved
    aside to ``work_dir/broken/`` with a warning, so the last complete checkpoint wins.
    """
    import re
    import warnings

    work_dir = Path(work_dir)
    if not work_dir.is_dir():
        return None
    found = [(int(m.group(1)), d) for d in work_dir.iterdir()
             if d.is_dir() and (m := re.fullmatch(r"checkpoint-(\d+)", d.name))]
    for _, ckpt in sorted(found, reverse=True):
        problem = checkpoint_problem(ckpt)
        if problem is None:
            return str(ckpt)
        aside = work_dir / "broken" / f"{ckpt.name}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        aside.parent.mkdir(exist_ok=True)
        ckpt.rename(aside)
        warnings.warn(f"checkpoint {ckpt} is incomplete ({problem}); moved it to {aside} and resuming from "
                      "the previous complete checkpoint (or from the start)", stacklevel=2)
    return None


def checkpoint_problem(ckpt: Path) -> str | None:
    """Why ``ckpt`` cannot be resumed from, or None when it is complete.

    HF's Trainer writes the weights, optimizer, scheduler and RNG state first and ``trainer_state.json``
    last, so a complete checkpoint has a state file that parses and names its own step, and every
    tensor file in it is whole: ``*.safetensors`` have a readable header and ``*.pt``/``*.pth`` (zip
    archives written by ``torch.save``) a readable central directory, which sits at the end of the
    file and so is missing from any truncated one. Cheap: nothing is loaded.
    """
    import zipfile

    ckpt = Path(ckpt)
    state = ckpt / "trainer_state.json"
    try:
        step = json.loads(state.read_text()).get("global_step")
    except (OSError, json.JSONDecodeError) as e:
        return f"{state.name} missing or unreadable: {e.__class__.__name__}"
    if step != checkpoint_step(str(ckpt)):
        return f"{state.name} says global_step={step}"
    tensors = [f for f in ckpt.rglob("*") if f.is_file() and f.suffix in (".safetensors", ".pt", ".pth", ".bin")]
    if not any(f.suffix in (".safetensors", ".bin") or f.parent.name.startswith("global_step") for f in tensors):
        return "no model weights"  # (DeepSpeed keeps its shards in global_stepN/)
    for f in tensors:
        if f.stat().st_size == 0:
            return f"{f.name} is empty"
        try:
            if f.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(str(f), framework="pt") as sf:
                    sf.keys()
            elif zipfile.is_zipfile(f):
                with zipfile.ZipFile(f) as z:
                    z.infolist()
            else:
                return f"{f.name} is truncated or not a torch.save archive"
        except Exception as e:  # noqa: BLE001 - any reader error means "not whole"
            return f"{f.name} is unreadable ({e.__class__.__name__}: {e})"
    return None


def checkpoint_step(ckpt: str | None) -> int:
    return int(Path(ckpt).name.split("-")[-1]) if ckpt else 0


def unwrap_for_save(trainer: Any) -> Any:
    """The trained model as a plain ``PreTrainedModel`` (LoRA merged into the base weights)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    if hasattr(model, "merge_and_unload"):  # peft: users load a plain HF folder, not an adapter
        model = model.merge_and_unload()
    return model


def finalize(trainer: Any, tokenizer: Any, final_dir: Path, work_dir: Path, *, stamp: dict[str, Any],
             metrics: Path | None = None, extra_files: dict[str, str] | None = None,
             keep_work: bool = False) -> Path:
    """Save model + tokenizer + metrics + stamp (+ ``extra_files`` name -> text) into ``final_dir``
    atomically; then drop the work dir."""
    final_dir = Path(final_dir)
    model = unwrap_for_save(trainer)
    fix_generation_config(model, tokenizer)
    with atomic_path(final_dir) as tmp:
        if getattr(trainer, "is_deepspeed_enabled", False) and model is trainer.accelerator.unwrap_model(trainer.model):
            trainer.save_model(str(tmp))  # gathers ZeRO-3 shards; ZeRO-2 holds full params anyway
        else:
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if metrics is not None and Path(metrics).exists():
            split_timings(Path(metrics), tmp / METRICS_FILE, timings_path(final_dir))
        if metrics is not None and (live := Path(metrics).parent / DVCLIVE_DIR).is_dir():
            shutil.copytree(live, tmp / live.name)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=2, sort_keys=True))
    if not keep_work:
        shutil.rmtree(work_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            work_dir.parent.rmdir()  # the shared .work folder, once empty
    return final_dir


def _file_digest(f: Path) -> str:
    h = hashlib.sha256()
    with f.open("rb") as fh:
        while block := fh.read(1 << 22):
            h.update(block)
    return h.hexdigest()


#: Wall-clock fields of the per-step rows: kept out of the model folder (a DVC output) so that two
#: seeded runs write identical bytes; they go to :func:`timings_path` (not an output), and to MLflow.
WALL_CLOCK_KEYS = ("time", "train_runtime", "train_samples_per_second", "train_steps_per_second")
#: suffixes of the wall-clock fields trainers add over versions (TRL 1.16's GRPO logs ``step_time``): a seeded
#: run's metrics must not hold them, or its DVC-tracked model folder hashes differently every run
_WALL_CLOCK_SUFFIXES = ("_time", "_runtime", "_per_second", "_seconds")


def is_wall_clock(key: str) -> bool:
    """Whether a logged field measures time (varies run to run): kept in ``.timings``, not in the metrics."""
    return key in WALL_CLOCK_KEYS or key.endswith(_WALL_CLOCK_SUFFIXES) or key.startswith("timing/")


def timings_path(final_dir: Path) -> Path:
    """Where a stage's wall-clock rows live: ``models/iter_k/.timings/<name>.jsonl``, beside (not inside) the output."""
    final_dir = Path(final_dir)
    return final_dir.parent / ".timings" / f"{final_dir.name}.jsonl"


def split_timings(src: Path, metrics_out: Path, timings_out: Path) -> None:
    """Copy ``src``'s rows to ``metrics_out`` without wall-clock fields, and those fields (with stage and
    step) to ``timings_out``."""
    rows = read_metrics(src)
    metrics_out.write_text("".join(json.dumps({k: v for k, v in r.items() if not is_wall_clock(k)}) + "\n"
                                   for r in rows))
    timed = [{"stage": r.get("stage"), "step": r.get("step"), **{k: v for k, v in r.items() if is_wall_clock(k)}}
             for r in rows if any(is_wall_clock(k) for k in r)]
    timings_out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(timings_out) as tmp:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in timed))


def fingerprint(params: Any, inputs: Iterable[Path], code_of: Iterable[str] | None = None) -> dict[str, Any]:
    """What a stage's output depends on: its params, the content (size, sha256) of each input file/model folder (content, not
    mtime or location: the stamp is part of a DVC-tracked output, so two clean runs must write the same
    bytes wherever the checkout is; params must not hold absolute paths either), and
    the code it runs: the import closure of ``code_of`` (default: the calling stage's module) and the
    third-party versions (:func:`apprentice.codedeps.digest`), so the plain CLI, like ``dvc repro``,
    retrains after a change to that code or a library upgrade."""
    import sys

    from apprentice import codedeps

    if code_of is None:  # the stage module that asks (apprentice.stages.sft, ...)
        code_of = [sys._getframe(1).f_globals.get("__name__", "apprentice.training.common")]
    code = codedeps.digest(*(m for m in code_of if m.startswith("apprentice")))
    def describe(p: Path) -> list[Any]:
        p = Path(p)
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file() and f.name not in (METRICS_FILE,))
            return [[str(f.relative_to(p)), f.stat().st_size, _file_digest(f)] for f in files]
        if p.exists():
            return [p.stat().st_size, _file_digest(p)]
        return ["missing"]

    # inputs by position, not by path: a clone elsewhere (a second machine, CI) must stamp the same bytes
    blob = json.dumps({"params": params, "inputs": [describe(p) for p in inputs], "code": code},
                      sort_keys=True, default=str)
    return {"fingerprint": hashlib.sha256(blob.encode()).hexdigest()[:16]}


def is_done(final_dir: Path, stamp: dict[str, Any]) -> bool:
    """True when ``final_dir`` holds a finished output with the same fingerprint (skip the stage)."""
    f = Path(final_dir) / STAMP_FILE
    if not f.exists():
        return False
    try:
        return json.loads(f.read_text()).get("fingerprint") == stamp.get("fingerprint")
    except json.JSONDecodeError:
        return False


def work_dir_for(final_dir: Path) -> Path:
    """Checkpoints live beside (not inside) the final folder: ``models/iter_k/.work/<name>``."""
    final_dir = Path(final_dir)
    return final_dir.parent / ".work" / final_dir.name
