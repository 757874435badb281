"""Which layers should a pruned student keep?  Loss of layer-dropped students before any training.

For a teacher (default: the iteration's SFT model) and a student size (``--keep-every k``: as many
layers as every k-th + the last), prints the parameter ratio and, on the SFT set, the teacher's
loss and the loss of each pruning rule straight after pruning (``every``: 0, k, 2k, ... + last;
``influence``: ShortGPT block influence, first and last kept). Lower is a better warm-start point.

    python experiments/student_init.py --teacher models/iter_1/sft --keep-every 2
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from apprentice.data.trajectories import read_parquet, to_sft_records  # noqa: E402
from apprentice.lm.modeling import load_model, load_tokenizer  # noqa: E402
from apprentice.stages.distill import calibration_batches  # noqa: E402
from apprentice.training.student import (  # noqa: E402
    block_influence,
    block_layers,
    block_similarity,
    influence_layers,
    kept_layers,
    num_params,
    prune_layers,
)


@torch.no_grad()
def sft_loss(model, tok, records) -> float:  # noqa: ANN001
    """Token-mean NLL on the assistant tokens (what SFT minimises)."""
    tot, n = 0.0, 0
    for r in records:
        enc = tok.apply_chat_template(r["messages"], tools=r.get("tools") or None, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        ids = torch.tensor([enc["input_ids"]])
        mask = torch.tensor(enc["assistant_masks"][1:], dtype=torch.bool)
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits[mask], ids[0, 1:][mask], reduction="sum")
        tot, n = tot + float(nll), n + int(mask.sum())
    return tot / max(n, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", default=str(ROOT / "models/iter_1/sft"))
    ap.add_argument("--data", default=str(ROOT / "data/iter_1/sft.parquet"))
    ap.add_argument("--keep-every", type=int, default=2)
    ap.add_argument("--n", type=int, default=16, help="SFT records to score (the first 8 calibrate influence)")
    args = ap.parse_args()
    tok = load_tokenizer(args.teacher, "compact")
    teacher = load_model(args.teacher, dtype="fp32").eval()
    records = to_sft_records(read_parquet(args.data))
    held = records[8:8 + args.n]  # not the calibration records
    n_layers = teacher.config.num_hidden_layers
    size = len(kept_layers(n_layers, args.keep_every))
    bi = block_influence(teacher, calibration_batches(tok, records))
    print(f"teacher {args.teacher}: {n_layers} layers, {num_params(teacher) / 1e6:.1f} M params, "
          f"SFT loss {sft_loss(teacher, tok, held):.3f}")
    print("block influence per layer: " + " ".join(f"{i}:{b:.3f}" for i, b in enumerate(bi)))
    cal = calibration_batches(tok, records)
    block = block_layers(block_similarity(teacher, cal, n_layers - size), n_layers, size)
    for rule, keep in (("every", kept_layers(n_layers, args.keep_every)), ("influence", influence_layers(bi, size)),
                       ("block", block)):
        student = prune_layers(teacher, args.keep_every, keep).eval()
        ratio = num_params(student) / num_params(teacher)
        print(f"{rule:10s} keeps {len(keep)} layers {keep}: {100 * ratio:.1f} % params, "
              f"loss before warm-up {sft_loss(student, tok, held):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
