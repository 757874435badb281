"""Supervised fine-tuning on teacher trajectories: TRL ``SFTTrainer`` plus what the pipeline adds.

TRL does the work: conversational tool-calling records (``{"messages", "tools"}``), the chat template
with ``{% generation %}`` markers for the assistant-only loss, LoRA through ``peft_config``, DeepSpeed
through the ``deepspeed`` argument, checkpoints. This module adds:

* **Supervision horizon** (``sft.horizon_tokens`` = H): keep the first H tokens of each trajectory's
  *episode* (everything after the system prompt and the task). Why a knob: how much of a teacher
  trajectory is imitated shapes the agent (too short teaches quitting early, too long persisting
  past the point of use) and the gain from longer horizons saturates while their cost does not.
  The cut is at a **turn boundary**: we keep the longest prefix of whole turns, ending on an
  assistant turn, whose rendered episode tokens fit in H (at least the first assistant turn is
  kept). A token-level cut would leave half a ``<tool_call>`` JSON in the targets and teach the
  model malformed calls; with short turns the boundary cut differs from the token cut by at most
  one turn.
* **Arbitrary JSON in records**: tool-call arguments differ per tool, and Arrow unifies them into one
  struct (``{"direction": "up", "query": null}``), which the template then renders. The dataset is
  built with ``datasets.Json`` columns so each record keeps its own shape.
* **Padding-free batches with the LM head on supervised positions only, and one copy of a
  micro-batch's common prefix** (:class:`ApprenticeSFTTrainer`, :mod:`apprentice.training.packing`).
* Per-step metrics, resume, atomic final folder (``apprentice.training.common``).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from trl import SFTTrainer

from apprentice.config import SFTConfig
from apprentice.training import common, loggers

PREFIX_GROUP = "prefix_group"  # dataset column: conversations with equal values share their rendered prefix


def _render_len(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    text = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def episode_start(messages: Sequence[dict[str, Any]]) -> int:
    """Index of the first message after the system prompt and the task (the first user message)."""
    for i, m in enumerate(messages):
        if m.get("role") == "user":
            return i + 1
    return len(messages)


def apply_horizon(record: dict[str, Any], tokenizer: Any, horizon_tokens: int) -> dict[str, Any]:
    """Cut ``record`` to its first ``horizon_tokens`` episode tokens at a turn boundary (see module doc)."""
    messages, tools = list(record["messages"]), record.get("tools")
    if horizon_tokens <= 0:
        return record
    start = episode_start(messages)
    header = _render_len(tokenizer, messages[:start], tools)
    keep = None
    for end in range(start + 1, len(messages) + 1):
        if messages[end - 1].get("role") != "assistant":
            continue
        if keep is not None and _render_len(tokenizer, messages[:end], tools) - header > horizon_tokens:
            break
        keep = end
    if keep is None:  # no assistant turn at all: nothing to supervise either way
        return record
    return {**record, "messages": messages[:keep]}


def build_dataset(records: Sequence[dict[str, Any]], tokenizer: Any = None, horizon_tokens: int = 0,
                  max_length: int = 0) -> Any:
    """TRL conversational dataset with ``Json`` columns (see module doc), horizon and length cut applied."""
    from datasets import Dataset, Features, Json, List, Value

    if not records:
        raise ValueError("no SFT records: the validated trajectory table is empty; check the validate stage's "
                         "report (data/iter_k/sft.parquet)")
    if horizon_tokens > 0:
        records = [apply_horizon(r, tokenizer, horizon_tokens) for r in records]
    if max_length > 0:
        fitted = [fit_length(r, tokenizer, max_length) for r in records]
        records = [r for r in fitted if r is not None]
        if not records:
            raise ValueError(f"no SFT record fits sft.max_length={max_length} tokens even cut to its first assistant "
                             "turn; raise sft.max_length")
    if any(context_turns(r) > episode_start(r["messages"]) for r in records):
        # some records train on a continuation only (repair data): TRL's conversational prompt-completion
        # form masks the prompt (completion_only_loss) and, with assistant_only_loss, the tool turns too;
        # a plain record becomes prompt = [system, task], which masks exactly what it masked before
        split = [(list(r["messages"][:max(context_turns(r), episode_start(r["messages"]))]),
                  list(r["messages"][max(context_turns(r), episode_start(r["messages"])):]), r) for r in records]
        rows = [{"prompt": p, "completion": c, "tools": list(r.get("tools") or []), PREFIX_GROUP: prefix_group(r)}
                for p, c, r in split if c]
        if not rows:
            raise ValueError("every SFT record is all context (context_turns covers all its messages); nothing "
                             "to train on")
        return Dataset.from_list(rows, features=Features({"prompt": List(Json()), "completion": List(Json()),
                                                          "tools": List(Json()), PREFIX_GROUP: Value("string")}))
    rows = [{"messages": list(r["messages"]), "tools": list(r.get("tools") or []), PREFIX_GROUP: prefix_group(r)}
            for r in records]
    return Dataset.from_list(rows, features=Features({"messages": List(Json()), "tools": List(Json()),
                                                      PREFIX_GROUP: Value("string")}))


def prefix_group(record: dict[str, Any]) -> str:
    """What a conversation's rendered prefix depends on before its first user turn: the system
    messages and the tool schemas. Conversations with equal keys share that prefix token for token
    (one environment family), which :class:`~apprentice.training.packing.PrefixGroupedSampler` batches
    together and :func:`~apprentice.training.packing.share_prefix` encodes once."""
    messages = list(record.get("messages") or record.get("prompt") or [])
    head = messages[:max(episode_start(messages) - 1, 0)]
    return hashlib.sha1(json.dumps([head, list(record.get("tools") or [])], sort_keys=True, default=str)
                        .encode()).hexdigest()


def context_turns(record: dict[str, Any]) -> int:
    """How many leading messages of ``record`` are context only (0: the system prompt and task only)."""
    return int(record.get("context_turns") or 0)


def lora_config(r: int) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def sft_trl_config(sft: SFTConfig, output_dir: Path, dtype: str, fast: bool = True, warmup_steps: int = 0,
                   **extra: Any) -> Any:
    """The ``trl.SFTConfig`` our stage runs with (the benchmark builds raw TRL from the same values).

    ``fast``: padding-free batches (records are pre-cut to ``max_length`` by :func:`fit_length`, so TRL's
    own truncation is off); ``fast=False`` is TRL's padded default. ``warmup_steps``: linear warm-up of
    the learning rate (the loop's ``continue`` rule: a fresh AdamW's first steps are sign-like steps of
    the full learning rate on every weight, see :mod:`apprentice.training.loop_rules`)."""
    from trl import SFTConfig as TRLSFTConfig

    length = {"padding_free": True, "max_length": None} if fast else {"max_length": sft.max_length}
    return common.trl_args(
        TRLSFTConfig, output_dir, dtype=dtype, max_steps=sft.max_steps, batch_size=sft.batch_size,
        grad_accum=sft.grad_accum, learning_rate=sft.learning_rate, save_steps=sft.save_steps, seed=sft.seed,
        deepspeed=common.deepspeed_config(sft.deepspeed), assistant_only_loss=True, warmup_steps=warmup_steps,
        **length, **extra,
    )


class ApprenticeSFTTrainer(SFTTrainer):
    """TRL's ``SFTTrainer`` with padding-free batches and the LM head on loss positions only.

    Same objective and metrics as TRL (token-mean NLL over assistant tokens, normalised by
    ``num_items_in_batch`` under gradient accumulation; ``entropy``, ``mean_token_accuracy``,
    ``num_tokens``); see :mod:`apprentice.training.packing` for why and what it saves. Overrides
    the public ``compute_loss`` and appends to TRL's ``_metrics`` (TRL is pinned exactly; a contract
    test checks both).
    """

    share_prefix = True  # False: padding-free batches alone (bench/train_throughput.py measures the difference)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._seen_tokens = 0

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        """Micro-batches of one prefix group (:class:`~apprentice.training.packing.PrefixGroupedSampler`)
        on the padding-free path; transformers' own sampler otherwise. Overrides a private method of the
        pinned transformers (contract test: tests/unit/test_library_contracts.py)."""
        from apprentice.training.packing import PrefixGroupedSampler

        data: Any = self.train_dataset
        if (not self.share_prefix or not getattr(self.args, "padding_free", False) or self.args.train_batch_size < 2
                or PREFIX_GROUP not in getattr(data, "column_names", ())
                or (train_dataset is not None and len(train_dataset) != len(data))):
            return super()._get_train_sampler(train_dataset)
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        return PrefixGroupedSampler(data[PREFIX_GROUP], self.args.train_batch_size, seed)

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        from apprentice.training.packing import VARLEN, attention_of, compact_nll, share_prefix

        if return_outputs or getattr(self.args, "loss_type", "nll") != "nll" or self.label_smoother is not None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # accelerate puts mixed precision on ``model.forward`` (the Trainer leaves autocast to it);
        # compact_nll calls the backbone and the head directly, so it needs the context itself: without
        # it the bf16 setting would silently train in fp32
        # only sdpa_varlen attends a shared prefix (a model left on flash attention keeps whole sequences)
        shared = share_prefix(inputs)[0] if self.share_prefix and attention_of(model) == VARLEN else inputs
        with self.accelerator.autocast():
            nll, st = compact_nll(model, shared)
        denom = st["n"] if num_items_in_batch is None else num_items_in_batch
        loss = nll / torch.as_tensor(denom).clamp(min=1)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes
        mode = "train" if model.training else "eval"
        n = max(int(st["n"]), 1)
        self._metrics[mode]["entropy"].append(float(st["entropy_sum"]) / n)
        self._metrics[mode]["mean_token_accuracy"].append(float(st["correct"]) / n)
        if mode == "train":
            ids = inputs["input_ids"]
            real = inputs["attention_mask"].sum() if "attention_mask" in inputs else ids.numel()
            self._seen_tokens += int(real)
            self._metrics[mode]["num_tokens"] = [self._seen_tokens]
        return loss


def fit_length(record: dict[str, Any], tokenizer: Any, max_length: int) -> dict[str, Any] | None:
    """``record`` cut at the last assistant turn boundary that fits ``max_length`` tokens (None if none does).

    Padding-free batches are not truncated by TRL, and a token-level cut would leave half a tool call
    in the targets anyway; a turn-boundary cut keeps every supervised turn whole."""
    messages, tools = list(record["messages"]), record.get("tools")
    if _render_len(tokenizer, messages, tools) <= max_length:
        return record
    for end in range(len(messages) - 1, episode_start(messages), -1):
        if messages[end - 1].get("role") == "assistant" and _render_len(tokenizer, messages[:end], tools) <= max_length:
            return {**record, "messages": messages[:end]}
    return None


def _zero_stage(trainer: Any) -> int | None:
    """The ZeRO stage the run really used (None without DeepSpeed): what the DeepSpeed test checks."""
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return None
    return int(trainer.accelerator.state.deepspeed_plugin.zero_stage)


def train_sft(model: Any, tokenizer: Any, records: Sequence[dict[str, Any]], final_dir: Path, sft: SFTConfig, *,
              dtype: str = "auto", stamp: dict[str, Any] | None = None, callbacks: Sequence[Any] = (),
              stage: str = "sft", warmup_steps: int = 0) -> dict[str, Any]:
    """Fine-tune ``model`` (path or loaded) on ``records``; write ``final_dir``; resume if checkpoints exist.

    A record may carry ``context_turns`` = n: its first n messages are context only (no loss), the
    loop's ``repair`` data (see :func:`build_dataset`).

    Returns a summary: steps, the step it resumed from, final loss, wall time, metrics path.
    """
    from transformers import set_seed

    from apprentice.lm.modeling import load_model
    from apprentice.training.packing import use_varlen

    t0 = time.time()
    final_dir = Path(final_dir)
    work = common.work_dir_for(final_dir)
    work.mkdir(parents=True, exist_ok=True)
    metrics = work / common.METRICS_FILE
    set_seed(sft.seed)
    dataset = build_dataset(records, tokenizer, sft.horizon_tokens, sft.max_length)
    if isinstance(model, str | Path):
        model = load_model(model, dtype="fp32")  # fp32 master weights; bf16 runs as autocast
    model.train()
    restore_attn = use_varlen(model)
    args = sft_trl_config(sft, work, dtype, warmup_steps=warmup_steps)
    ckpt = common.last_checkpoint(work)
    common.trim_metrics(metrics, stage, common.checkpoint_step(ckpt))
    logged = common.MetricsCallback(metrics, stage)  # after the trim: it continues the kept rows
    trainer = ApprenticeSFTTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
        peft_config=lora_config(sft.lora_r) if sft.lora else None,
        callbacks=[logged, *loggers.callbacks(stage, logged), *callbacks],
    )
    try:
        out = trainer.train(resume_from_checkpoint=ckpt)
        zero_stage = _zero_stage(trainer)
        model.set_attn_implementation(restore_attn)  # the saved model must load anywhere
        common.finalize(trainer, tokenizer, final_dir, work, stamp=stamp or {}, metrics=metrics)
    finally:
        if sft.deepspeed != "none":
            common.release_distributed()
    return {
        "model": str(final_dir),
        "steps": int(trainer.state.global_step),
        "resumed_from_step": common.checkpoint_step(ckpt),
        "train_loss": common.summary_train_loss(final_dir / common.METRICS_FILE, stage, out.training_loss),
        "examples": len(dataset),
        "deepspeed_zero_stage": zero_stage,
        "wall_s": round(time.time() - t0, 1),
        "metrics": str(final_dir / common.METRICS_FILE),
    }
