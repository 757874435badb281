"""Loop rules: what iteration k > 1 trains on and where it starts, as pure functions.

Why a rule at all: continuing from the champion exactly as iteration 1 starts from the base model
(the full ``sft.learning_rate``, a fresh AdamW, no warm-up) on fresh problems only loses ground the
champion had. A fresh AdamW's first update is ``lr * m / sqrt(v)`` ~ ``lr * sign(g)`` on *every*
weight whatever the gradient's size; on data the model already fits the gradient is mostly noise,
so the first steps are full-size steps in noisy directions (``experiments/continue_sft.py`` measures the
held-out NLL along such a continuation). The rules (``loop.rule``; docs/experiments.md compares
them):

* ``continue``: from the champion at ``sft.learning_rate x loop.lr_factor`` with ``loop.warmup_steps``
  of warm-up (and GRPO at ``rl.learning_rate x loop.lr_factor``), on the new validated data plus a
  ``loop.replay_share`` of earlier iterations' validated data (replay against forgetting);
* ``restart``: from the base model at the full learning rate on the union of all iterations'
  validated data (no drift can accumulate across iterations), as in ReST-EM ("Beyond Human Data:
  Scaling Self-Training for Problem-Solving with Language Models", arXiv:2312.06585) and expert
  iteration ("Thinking Fast and Slow with Deep Learning and Tree Search", arXiv:1705.08439);
* ``self``: ``continue``, with ``loop.self_share`` of the new data replaced by the champion's own
  verifier-passed rollouts on the new problems (rejection sampling, as in "STaR: Bootstrapping
  Reasoning With Reasoning", arXiv:2203.14465, and AgentEvol in "AgentGym: Evolving Large Language
  Model-based Agents across Diverse Environments", arXiv:2406.04151);
* ``repair``: ``continue``, with ``loop.repair_share`` of the new data replaced by the champion's
  failed episodes cut at their first error and continued by the teacher, trained on the
  continuation only (the student learns to recover from the states its own mistakes lead to).

Everything here is a function of tables (pandas) and seeds: the stage
(:mod:`apprentice.stages.loop_data`) runs the rollouts and the gate, this module decides.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

#: Rules that start iteration k > 1 from the champion (the others start from the base model).
FROM_CHAMPION = ("continue", "self", "repair")
#: The column a training row carries for "the first n messages are context only" (repair rows).
CONTEXT = "context_turns"
SOURCE = "loop_source"


def starts_from_champion(rule: str, iteration: int) -> bool:
    return iteration > 1 and rule in FROM_CHAMPION


def sft_schedule(rule: str, iteration: int, learning_rate: float, lr_factor: float,
                 warmup_steps: int, trained_start: bool = True) -> tuple[float, int]:
    """(learning rate, warm-up steps) of iteration ``iteration``'s SFT under ``rule``.

    ``trained_start``: the champion is a trained model. While no candidate has beaten the base model
    the champion *is* the base model, nothing fits the data yet, and the base recipe applies."""
    if starts_from_champion(rule, iteration) and trained_start:
        return learning_rate * lr_factor, warmup_steps
    return learning_rate, 0


def rl_learning_rate(rule: str, iteration: int, learning_rate: float, lr_factor: float,
                     trained_start: bool = True) -> float:
    """Iteration ``iteration``'s GRPO learning rate: ``rl.learning_rate`` scaled by ``loop.lr_factor``
    whenever SFT's is (the iteration continues from a trained champion).

    Why: GRPO's few steps under a fresh AdamW are ``lr * sign(g)``-sized on every weight (the module
    docstring), so at the full rate three GRPO steps on a dozen episodes move a continued model as far as
    its whole iteration of SFT did, and undo the newest skill SFT taught it (docs/experiments.md, "RL-2
    undoes the climb"). Scaled with SFT's rate, RL stays the smaller step it is in iteration 1."""
    return sft_schedule(rule, iteration, learning_rate, lr_factor, 0, trained_start)[0]


def sft_steps(iteration: int, max_steps: int, loop_steps: int) -> int:
    """Iteration ``iteration``'s SFT steps: ``sft.max_steps`` in iteration 1, ``loop.max_steps`` (when > 0)
    after it, where the set is the new data plus the replay of earlier iterations'."""
    return loop_steps if iteration > 1 and loop_steps > 0 else max_steps


def _tagged(df: pd.DataFrame, source: str) -> pd.DataFrame:
    out = df.copy()
    out[SOURCE] = source
    if CONTEXT not in out.columns:
        out[CONTEXT] = 0
    out[CONTEXT] = out[CONTEXT].fillna(0).astype(int)
    return out


def _key(df: pd.DataFrame) -> pd.Series:
    return df["problem_id"].astype(str) + "/" + df["policy_id"].astype(str) + "/" + df["sample_idx"].astype(str)


def union(frames: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """All rows of ``frames`` (oldest first), each episode once (problem, policy, sample)."""
    if not frames:
        raise ValueError("union of no tables: there is no validated data yet")
    cat = pd.concat(list(frames), ignore_index=True)
    return cat.loc[~_key(cat).duplicated()].reset_index(drop=True)


def replay(new: pd.DataFrame, earlier: Sequence[pd.DataFrame], share: float, seed: int) -> pd.DataFrame:
    """``new`` plus rows drawn (seeded, without replacement) from ``earlier`` so that they make up
    ``share`` of the result: ``round(len(new) * share / (1 - share))`` rows, or all there are."""
    if not 0 <= share < 1:
        raise ValueError(f"replay share must be in [0, 1), got {share}")
    if share == 0 or not earlier:
        return new.reset_index(drop=True)
    pool = union(earlier)
    pool = pool.loc[~_key(pool).isin(set(_key(new)))]
    want = min(len(pool), round(len(new) * share / (1 - share)))
    picked = pool.sample(n=want, random_state=seed) if want else pool.head(0)
    return pd.concat([new, picked], ignore_index=True)


def mix(teacher: pd.DataFrame, own: pd.DataFrame, share: float, seed: int) -> tuple[pd.DataFrame, int]:
    """The new data with ``share`` of it from ``own`` (self-generated or repaired rows): keep
    ``n_own = min(len(own), round(len(teacher) * share))`` of them and drop as many teacher rows, so
    the set keeps its size. Returns (rows, n_own)."""
    if not 0 <= share <= 1:
        raise ValueError(f"mix share must be in [0, 1], got {share}")
    n_own = min(len(own), round(len(teacher) * share))
    own_rows = own.sample(n=n_own, random_state=seed) if n_own < len(own) else own
    keep_teacher = teacher.sample(n=len(teacher) - n_own, random_state=seed) if n_own else teacher
    return pd.concat([keep_teacher, own_rows], ignore_index=True), n_own


def _calls(message: Mapping[str, Any]) -> list[tuple[str, str]]:
    out = []
    for c in message.get("tool_calls") or []:
        fn = c.get("function", c) if isinstance(c, Mapping) else {}
        args = fn.get("arguments", {})
        if isinstance(args, str):
            with contextlib.suppress(json.JSONDecodeError):
                args = json.loads(args)
        out.append((str(fn.get("name")), json.dumps(args, sort_keys=True)))
    return out


def first_error(messages: Sequence[Mapping[str, Any]], plan: Sequence[Mapping[str, Any]]) -> int | None:
    """Index (into ``messages``) of the first assistant turn that leaves the teacher's path: its call
    is not the oracle plan's call at that turn (a wrong action, an invalid call, a malformed turn or
    no call at all). None when every assistant turn follows the plan.

    Why "leaves the plan" and not "the first error observation": a wrong move can be legal (no
    error shown) and still lose the episode; and the state before the first departure is the
    teacher's own state, so the teacher's continuation from it is valid by construction for any
    family (replayed in a fresh environment, :func:`apprentice.rollout.episodes.run_episodes` ``starts``)."""
    k = 0
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        want = [(str(plan[k]["name"]), json.dumps(plan[k].get("arguments", {}), sort_keys=True))] if k < len(plan) else None
        if want is None or _calls(m) != want:
            return i
        k += 1
    return None


def repair_starts(failed: pd.DataFrame, plans: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[tuple[int, list[dict]]]:
    """Per failed episode (row position, assistant turns to replay): the prefix before its first error.
    Episodes whose every turn follows the plan (they ran out of budget on the right path) are skipped."""
    out = []
    for pos, row in enumerate(failed.itertuples(index=False)):
        msgs = json.loads(row.messages)
        cut = first_error(msgs, plans[str(row.problem_id)])
        if cut is None:
            continue
        start = 2  # [system, task]
        out.append((pos, [m for m in msgs[start:cut] if m.get("role") == "assistant"]))
    return out
