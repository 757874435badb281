"""Dynamic sampling for TRL's ``GRPOTrainer``: a group whose rewards are all equal is replaced before the step.

Why: GRPO's advantage is a reward minus its group's mean, so a group whose episodes all succeed or all
fail has zero advantage everywhere and adds nothing to the gradient. With 4 samples a group is
uniform with probability p^4 + (1 - p)^4: 12.5 % at a pass rate of 0.5 but 66 % at 0.1 or 0.9, and a
step whose groups are all uniform is a step of pure cost (loss 0, grad norm 0). DAPO drops such groups
and samples more prompts until the batch is full of groups with variance ("DAPO: An Open-Source LLM
Reinforcement Learning System at Scale", arXiv 2503.14476, "dynamic sampling"). TRL has no switch for
it, so :class:`DynamicSampling` wraps TRL's own ``_generate_and_score_completions``: it calls it on the
step's prompts, keeps the groups with variance, and calls it again on fresh prompts from a refill pool
(the frontier band's other problems) for as many groups as were dropped, up to
``refill_rounds`` times; the groups are merged into the batch TRL would have returned (same keys,
prompts left-padded and completions right-padded as TRL pads them, ``num_items_in_batch`` recounted).

Departures from DAPO: the refill is bounded (``refill_rounds``, so a step's cost is bounded; a batch
still short is filled with uniform groups, which cost their forward pass and change nothing), and
each advantage is TRL's own, computed within its group, so merging groups from several calls gives the
advantages one call would have given (true for ``scale_rewards`` "group" or "none", TRL's group-wise
modes; under "batch" the wrapper stands aside). Each call's TRL metrics are logged as TRL logs them;
this adds ``dynamic/live_groups`` (share of the step's groups with reward variance),
``dynamic/groups_sampled`` and ``dynamic/clipped`` (share of the step's episodes cut off by the
completion budget).

Overrides TRL's private ``_generate_and_score_completions`` (TRL pinned exactly; contract test in
``tests/unit/test_library_contracts.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

#: keys of TRL's output padded on the left (the prompts); every other 2-D tensor is padded on the right
LEFT_PADDED = ("prompt_ids", "prompt_mask")


def live_groups(advantages: torch.Tensor, group: int) -> list[bool]:
    """Per group of ``group`` consecutive rows: whether any advantage is non-zero (its rewards vary)."""
    return (advantages.detach().view(-1, group).abs().sum(dim=1) > 0).tolist()


def truncated(out: dict[str, Any], stop_ids: Sequence[int]) -> list[bool]:
    """Per row: whether the completion ends on something other than a stop id (cut off by the budget)."""
    ids, mask = out["completion_ids"], out["completion_mask"]
    lengths = mask.sum(dim=1).tolist()
    stops = set(int(t) for t in stop_ids)
    return [n == 0 or int(ids[i, int(n) - 1]) not in stops for i, n in enumerate(lengths)]


def _pad(t: torch.Tensor, width: int, value: float | int, left: bool) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    fill = torch.full((t.shape[0], width - t.shape[1], *t.shape[2:]), value, dtype=t.dtype, device=t.device)
    return torch.cat([fill, t] if left else [t, fill], dim=1)


def merge_groups(parts: Sequence[tuple[dict[str, Any], int]], group: int, pad_id: int) -> dict[str, Any]:
    """One TRL batch from ``(output, group index)`` pairs: each group's rows taken from its output, every
    per-row tensor concatenated (2-D ones padded to the widest), ``num_items_in_batch`` recounted."""
    first = parts[0][0]
    merged: dict[str, Any] = {}
    for key, value in first.items():
        if key == "num_items_in_batch" or not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        rows = [out[key][g * group:(g + 1) * group] for out, g in parts]
        if value.dim() >= 2:
            width = max(r.shape[1] for r in rows)
            pad = pad_id if key.endswith("_ids") else 0
            rows = [_pad(r, width, pad, key in LEFT_PADDED) for r in rows]
        merged[key] = torch.cat(rows, dim=0)
    for key, value in first.items():  # non-tensor or scalar entries: kept from the first output
        if key not in merged and key != "num_items_in_batch":
            merged[key] = value
    if "num_items_in_batch" in first:
        loss_mask = merged["completion_mask"] if "tool_mask" not in merged else merged["completion_mask"] * merged["tool_mask"]
        merged["num_items_in_batch"] = loss_mask.sum().to(first["num_items_in_batch"].device)
    return merged


class DynamicSampling:
    """Mixin for ``GRPOTrainer`` (before it in the bases): drop uniform groups, refill from a pool."""

    refill_rounds: int = 2
    _refill_pool: list[dict[str, Any]]
    _refill_cursor: int = 0
    dynamic_log: list[dict[str, float]]

    def set_refill_pool(self, rows: Sequence[dict[str, Any]], rounds: int) -> None:
        """The dataset rows dropped groups are replaced from, in order (each used once, then cycled)."""
        self._refill_pool, self._refill_cursor, self.refill_rounds = list(rows), 0, rounds
        self.dynamic_log = []

    def _draw(self, n: int) -> list[dict[str, Any]]:
        pool = getattr(self, "_refill_pool", [])
        out = []
        for _ in range(min(n, len(pool))):
            out.append(pool[self._refill_cursor % len(pool)])
            self._refill_cursor += 1
        return out

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        t: Any = self
        out = super()._generate_and_score_completions(inputs)  # type: ignore[misc]
        group = int(t.num_generations)
        if (not t.model.training or getattr(t, "scale_rewards", "group") == "batch" or "pixel_values" in out
                or len(inputs) % group):
            return out
        stop = [*t.eos_token_ids, t._tokenizer.pad_token_id]
        n_groups = len(inputs) // group
        live: list[tuple[dict[str, Any], int]] = []
        dead: list[tuple[dict[str, Any], int]] = []
        clipped: dict[int, list[bool]] = {id(out): truncated(out, stop)}
        for g, ok in enumerate(live_groups(out["advantages"], group)):
            (live if ok else dead).append((out, g))
        sampled, rounds = n_groups, 0
        while len(live) < n_groups and rounds < self.refill_rounds:
            rows = self._draw(n_groups - len(live))
            if not rows:
                break
            more = super()._generate_and_score_completions([r for r in rows for _ in range(group)])  # type: ignore[misc]
            clipped[id(more)] = truncated(more, stop)
            for g, ok in enumerate(live_groups(more["advantages"], group)):
                (live if ok else dead).append((more, g))
            sampled, rounds = sampled + len(rows), rounds + 1
        chosen = (live + dead)[:n_groups]
        n_live = min(len(live), n_groups)
        cut = [c for o, g in chosen for c in clipped[id(o)][g * group:(g + 1) * group]]
        stats = {"live_groups": n_live / n_groups, "groups_sampled": float(sampled), "refill_rounds": float(rounds),
                 "clipped": sum(cut) / len(cut)}
        for k, v in stats.items():
            t._metrics["train"][f"dynamic/{k}"].append(v)
        getattr(self, "dynamic_log", []).append(stats)
        if all(o is out for o, _ in chosen) and [g for _, g in chosen] == list(range(n_groups)):
            return out  # nothing replaced: TRL's own batch, untouched
        return merge_groups(chosen, group, t._tokenizer.pad_token_id)
