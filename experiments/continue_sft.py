"""Why SFT-2 (continued from the champion) scored below SFT-1, measured cheaply.

A 40-problem greedy benchmark cannot resolve the question (Wilson half-width ~15 points), so this
measures the held-out teacher NLL (:mod:`apprentice.training.heldout`: assistant tokens of teacher
trajectories of a third, untrained iteration's problems) along three runs on the real model:

1. ``sft1``: the base model, ``--steps1`` SFT steps on iteration 1's validated data (the default recipe);
2. ``old``: continue from ``sft1`` on iteration 2's data exactly as iteration 2 did before the loop rules
   (full ``sft.learning_rate``, fresh AdamW, no warm-up);
3. ``new``: the same continuation under the ``continue`` rule (``loop.lr_factor`` x the learning rate,
   ``loop.warmup_steps`` warm-up).

The held-out NLL is logged after every continuation step, so a rise in the first steps (the
fresh-optimizer shock) shows directly. Inputs: a work dir where ``validate --iter 1/2/3`` ran.

    nice -n 10 .venv/bin/python experiments/continue_sft.py --work /tmp/L_diag --steps1 8 --steps2 4
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from transformers import TrainerCallback


class HeldoutEvery(TrainerCallback):
    def __init__(self, tok, records, rows, label):  # noqa: ANN001
        self.tok, self.records, self.rows, self.label = tok, records, rows, label

    def on_step_end(self, args, state, control, model=None, **kw):  # noqa: ANN001
        from apprentice.training.heldout import heldout_nll

        m = heldout_nll(model, self.tok, self.records)
        self.rows.append({"run": self.label, "step": state.global_step, **m})
        print(json.dumps(self.rows[-1]), flush=True)


def main() -> None:
    from apprentice.config import load_config
    from apprentice.data.trajectories import read_parquet, to_sft_records
    from apprentice.lm.modeling import load_model, load_tokenizer
    from apprentice.paths import Paths
    from apprentice.training.heldout import heldout_nll
    from apprentice.training.sft import train_sft

    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--steps1", type=int, default=8)
    ap.add_argument("--steps2", type=int, default=4)
    ap.add_argument("--heldout", type=int, default=16)
    ap.add_argument("--lr-factor", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", type=Path, help="where the rows go (default: <work>/continue_sft.json)")
    a = ap.parse_args()
    a.out = a.out or a.work / "continue_sft.json"
    cfg = load_config(a.work / "params.yaml")
    base = str(a.work / "models" / "base")
    tok = load_tokenizer(base, cfg.model.chat_template)
    recs = {k: to_sft_records(read_parquet(Paths(a.work, k).sft_data)) for k in (1, 2, 3)}
    held = recs[3][:a.heldout]
    rows: list[dict] = []
    t0 = time.time()
    rows.append({"run": "base", "step": 0, **heldout_nll(load_model(base), tok, held)})
    print(json.dumps(rows[-1]), flush=True)
    out = a.work / "models" / "L_diag"
    sft1 = cfg.sft.model_copy(update={"max_steps": a.steps1, "save_steps": 10_000})
    if not (out / "sft1" / "config.json").exists():
        train_sft(base, tok, recs[1], out / "sft1", sft1, dtype=cfg.model.dtype)
    rows.append({"run": "sft1", "step": a.steps1, **heldout_nll(load_model(out / "sft1"), tok, held)})
    print(json.dumps(rows[-1]), flush=True)
    for label, lr, warm in (("old", cfg.sft.learning_rate, 0),
                            ("new", cfg.sft.learning_rate * a.lr_factor, a.warmup)):
        sft2 = cfg.sft.model_copy(update={"max_steps": a.steps2, "save_steps": 10_000, "learning_rate": lr})
        train_sft(str(out / "sft1"), tok, recs[2], out / label, sft2, dtype=cfg.model.dtype, warmup_steps=warm,
                  callbacks=[HeldoutEvery(tok, held, rows, label)])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"rows": rows, "args": {k: str(v) for k, v in vars(a).items()},
                                 "wall_s": round(time.time() - t0, 1)}, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
