"""Privileged self-distillation (OPSD): the teacher is the same model given context the student never
sees, here the environment oracle's plan or the final answer, inserted into the system prompt.

Why this shape: one function from (student messages, per-episode privileged context) to teacher
messages covers the OPSD family's "teacher = student + extra context"; other context kinds (skills,
hindsight, next-state hints) are more ``kind``s. Only the *system prompt* changes, so the
conversation after it tokenises identically for both views and the teacher's and student's
next-token distributions are aligned token by token.

The privileged data comes from the rollout engine's per-episode ``context`` (``oracle_plan``: the
oracle's tool calls, which the engine fills for policies with ``needs_oracle_plan``); it is never written
to a trajectory. ``answer`` is the oracle plan's final call: for a search problem, the submitted answer.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any, Literal

Kind = Literal["none", "oracle_plan", "answer"]

HEADER = "\n\nPrivileged hint (reference solution, not shown to the agent):\n"


def _call_text(call: Mapping[str, Any]) -> str:
    return f"{call['name']}({json.dumps(dict(call.get('arguments') or {}), sort_keys=True)})"


def hint_text(context: Mapping[str, Any], kind: Kind) -> str:
    """The privileged text for ``kind`` ('' for none). Raises if the context lacks the oracle plan."""
    if kind == "none":
        return ""
    plan = context.get("oracle_plan")
    if plan is None:
        raise ValueError("privileged context needs context['oracle_plan']; the rollout must run with a policy "
                         "that sets needs_oracle_plan=True (apprentice.training.opd.mixed.MixedPolicy does)")
    if kind == "oracle_plan":
        return "Solve it with these tool calls, in order: " + "; ".join(_call_text(c) for c in plan) + "."
    if kind == "answer":
        return ("The final step is: " + _call_text(plan[-1]) + ".") if plan else ""
    raise ValueError(f"unknown privileged context kind {kind!r}; use none, oracle_plan or answer")


def privileged_messages(messages: list[dict[str, Any]], context: Mapping[str, Any], kind: Kind) -> list[dict[str, Any]]:
    """A copy of ``messages`` whose system prompt carries the hint (unchanged when ``kind`` is none)."""
    text = hint_text(context, kind)
    out = copy.deepcopy(messages)
    if not text:
        return out
    if out and out[0].get("role") == "system":
        out[0]["content"] = str(out[0].get("content") or "") + HEADER + text
    else:
        out.insert(0, {"role": "system", "content": HEADER.strip() + "\n" + text})
    return out
