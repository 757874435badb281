"""Benchmark: supervised tokens per second of our SFT stage vs raw TRL ``SFTTrainer``, same data, same model.

Prints, in one run:

1. **where the training tokens go** (the audit): system prompt, tool schemas, task, assistant turns
   (the only tokens that carry loss), tool responses, and the padding a right-padded batch adds;
2. three trainers side by side on the same records, model, seed, batch size, learning rate and
   steps: wall time per step, loss-carrying tokens per second, the loss of every step. Raw TRL and
   "padding-free" draw the same batches in the same order (so the same supervised tokens and, up to
   float summation order, the same losses); "ours" draws micro-batches of one environment family
   and encodes their common prefix once (:class:`apprentice.training.packing.PrefixGroupedSampler`,
   :func:`~apprentice.training.packing.share_prefix`), so its batches, and its losses, differ;
3. ``prefix sharing <ours / padding-free supervised tokens per second>``, then its last line:
   ``ratio <ours / raw TRL supervised tokens per second>``.

"Raw TRL" is ``trl.SFTTrainer`` with its defaults (right-padded batches, its fused LM head, which
scores every position on CPU) and only the settings any CPU run needs (``use_cpu``, fp32, no
activation checkpointing: at this model size it only costs time) plus the
objective (``assistant_only_loss``). "Ours" is the stage's trainer
(:class:`apprentice.training.sft.ApprenticeSFTTrainer`: padding-free batches with per-sequence
attention, LM head on loss positions only, one copy of a micro-batch's common prefix;
:mod:`apprentice.training.packing`); "padding-free" is the same trainer without the shared prefix.

    python bench/train_throughput.py                # default profile's SFT set, models/base, 3 steps per run
    python bench/train_throughput.py --steps 2 --quick   # smoke check on the quick profile's tiny model

Needs ``models/base`` (``python -m apprentice prepare-base``); builds the SFT set in a temp dir
(benchmark -> synth -> oracle rollout -> validate) unless ``--data`` names one.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from apprentice.config import load_config  # noqa: E402
from apprentice.data.trajectories import read_parquet, to_sft_records  # noqa: E402
from apprentice.lm.modeling import load_model, load_tokenizer  # noqa: E402
from apprentice.paths import Paths  # noqa: E402
from apprentice.training import sft as sft_mod  # noqa: E402
from apprentice.training.packing import use_varlen  # noqa: E402


def sft_records(cfg: Any, data: str) -> list[dict[str, Any]]:
    if data:
        return to_sft_records(read_parquet(data))
    from apprentice.stages import benchmark, rollout, synth, validate

    root = Path(tempfile.mkdtemp(prefix="tt-"))
    paths = Paths(root, 1)
    (root / "models").mkdir()
    os.symlink(ROOT / "models" / "base", root / "models" / "base")
    if (ROOT / "models" / "tiny").exists():
        os.symlink(ROOT / "models" / "tiny", root / "models" / "tiny")
    for stage in (benchmark, synth, rollout, validate):
        stage.run(cfg, paths)
    return to_sft_records(read_parquet(paths.sft_data))


# ---- 1. the audit --------------------------------------------------------------------------------
def audit(records: list[dict[str, Any]], tok: Any, batch_size: int, seed: int) -> dict[str, int]:
    """Tokens by kind over the whole set, plus the padding of right-padded batches in the trainer's order."""
    def n(msgs: list[dict[str, Any]], tools: Any) -> int:
        return sft_mod._render_len(tok, msgs, tools)

    out = {"system prompt": 0, "tool schemas": 0, "task": 0, "assistant turns (loss)": 0, "tool responses": 0,
           "template/other": 0}
    lengths = []
    for r in records:
        msgs, tools = r["messages"], r.get("tools") or None
        total = n(msgs, tools)
        lengths.append(total)
        sys_only, with_tools = n(msgs[:1], None), n(msgs[:1], tools)
        out["system prompt"] += sys_only
        out["tool schemas"] += with_tools - sys_only
        prev = with_tools
        for i in range(1, len(msgs)):
            cur = n(msgs[: i + 1], tools)
            role = msgs[i]["role"]
            key = {"assistant": "assistant turns (loss)", "tool": "tool responses"}.get(role, "task" if i == 1 else
                                                                                        "tool responses")
            out[key] += cur - prev
            prev = cur
        out["template/other"] += total - prev
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(lengths), generator=g).tolist()
    pad = 0
    for i in range(0, len(order), batch_size):
        chunk = [lengths[j] for j in order[i:i + batch_size]]
        pad += max(chunk) * len(chunk) - sum(chunk)
    out["padding (right-padded batches)"] = pad
    return out


# ---- 2. the two trainers -------------------------------------------------------------------------
class Clock(TrainerCallback):
    def __init__(self) -> None:
        self.t: list[float] = []
        self.loss: list[float] = []

    def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001
        if not self.t:
            self.t.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
        self.t.append(time.perf_counter())

    def on_log(self, args, state, control, logs=None, **kw):  # noqa: ANN001
        if logs and "loss" in logs:
            self.loss.append(float(logs["loss"]))


def counting(cls: type) -> type:
    """``cls`` that also counts the loss-carrying tokens it trains on (labels != -100 after the shift)."""
    class Counted(cls):  # type: ignore[valid-type, misc]
        supervised = 0

        def compute_loss(self, model, inputs, *a, **kw):  # noqa: ANN001
            type(self).supervised += int((inputs["labels"][:, 1:] != -100).sum())
            return super().compute_loss(model, inputs, *a, **kw)
    Counted.supervised = 0
    return Counted


def train(kind: str, cfg: Any, records: list[dict[str, Any]], tok: Any, steps: int, model_dir: str) -> dict[str, Any]:
    from trl import SFTTrainer

    sft = cfg.sft.model_copy(update={"max_steps": steps, "save_steps": 10_000})
    work = Path(tempfile.mkdtemp(prefix=f"tt-{kind}-"))
    fast = kind != "raw TRL"
    dataset = sft_mod.build_dataset(records, tok, 0, sft.max_length if fast else 0)
    torch.manual_seed(sft.seed)
    model = load_model(model_dir, dtype="fp32")
    model.train()
    if fast:
        use_varlen(model)
    args = sft_mod.sft_trl_config(sft, work, cfg.model.dtype, fast=fast, save_strategy="no", disable_tqdm=True)
    cls = counting(sft_mod.ApprenticeSFTTrainer if fast else SFTTrainer)
    cls.share_prefix = kind == "ours"
    clock = Clock()
    trainer = cls(model=model, args=args, train_dataset=dataset, processing_class=tok, callbacks=[clock])
    trainer.train()
    wall = clock.t[-1] - clock.t[0]
    return {"kind": kind, "wall_s": wall, "supervised": cls.supervised, "loss": clock.loss,
            "tok_s": cls.supervised / wall}


def _merge(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """Both runs of one trainer: summed time and tokens; the loss curve of the first (same seed: same curve)."""
    wall, sup = sum(r["wall_s"] for r in rs), sum(r["supervised"] for r in rs)
    assert all(r["loss"] == rs[0]["loss"] for r in rs), "same seed and data must give the same losses"
    return {"kind": rs[0]["kind"], "wall_s": wall, "supervised": sup, "loss": rs[0]["loss"], "tok_s": sup / wall,
            "steps": sum(len(r["loss"]) for r in rs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per run (4 runs: A-B-B-A)")
    ap.add_argument("--quick", action="store_true", help="the quick profile (tiny model): a smoke check")
    ap.add_argument("--data", default="", help="an SFT parquet (default: build the default profile's)")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config(ROOT / "params.yaml", "quick" if args.quick else None)
    model_dir = str(ROOT / cfg.model.base)
    if not (Path(model_dir) / "config.json").exists():
        print(f"error: {model_dir} holds no model; run `python -m apprentice prepare-base` first", file=sys.stderr)
        return 2
    tok = load_tokenizer(model_dir, cfg.model.chat_template)
    records = sft_records(cfg, args.data)

    a = audit(records, tok, cfg.sft.batch_size, cfg.sft.seed)
    total = sum(a.values())
    print(f"token audit: {len(records)} SFT records, {total} tokens in right-padded batches of {cfg.sft.batch_size}")
    for k, v in a.items():
        print(f"  {k:32s} {v:8d}  {100 * v / total:5.1f} %")

    kinds = ("raw TRL", "padding-free", "ours")
    print(f"\ntraining {args.steps} steps per run, runs in the order {', '.join(kinds + kinds[::-1])}; "
          f"batch {cfg.sft.batch_size}, {model_dir}, threads={torch.get_num_threads()}", flush=True)
    # A-B-C-C-B-A: slow drift on a shared machine (other jobs starting or ending) hits every side equally
    runs = [train(kind, cfg, records, tok, args.steps, model_dir) for kind in kinds + kinds[::-1]]
    raw, free, ours = (_merge([r for r in runs if r["kind"] == k]) for k in kinds)
    for r in (raw, free, ours):
        print(f"  {r['kind']:12s} {r['wall_s']:7.1f} s  {r['wall_s'] / r['steps']:5.1f} s/step  "
              f"{r['supervised']} supervised tokens  {r['tok_s']:6.1f} tok/s  loss {[round(x, 4) for x in r['loss']]}")
    same = raw["supervised"] == free["supervised"]
    drift = abs(free["loss"][-1] - raw["loss"][-1]) / max(abs(raw["loss"][-1]), 1e-9)
    print(f"  same batches, raw vs padding-free: same supervised tokens {same}; final loss {100 * drift:.2f} % apart "
          "(target <= 5 %)")
    print(f"prefix sharing {ours['tok_s'] / free['tok_s']:.2f}")
    print(f"ratio {ours['tok_s'] / raw['tok_s']:.2f}")
    return 0 if drift <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
