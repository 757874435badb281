"""Mixed student/teacher multi-turn rollouts, and their conversion into training tensors.

Why a :class:`MixedPolicy` and not a new loop: the rollout engine (``apprentice.rollout.episodes.run_episodes``)
already runs many episodes in lock-step, executes tools, turns malformed calls into error observations
and caps turns. A mixed rollout differs only in *who* writes each assistant turn, which is exactly a
policy's job. ``MixedPolicy`` sets ``needs_oracle_plan`` so the engine hands it each episode's private
``context`` dict (the same object every turn): executor state lives there, and so does the oracle plan
a privileged teacher reads. Each assistant message gets an ``opd_actor`` key ("student"/"teacher");
chat templates ignore unknown keys, and :func:`encode_trajectories` reads it back to build the loss mask.

Discrepancy (DASH): after a turn, the action text is scored by both models and the turn's value is
``mean(log p_actor - log p_other)`` over its tokens (:func:`mean_logprobs`), computed only for
executors that need it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from apprentice.data.trajectories import Trajectory
from apprentice.envs import FAMILIES, Environment, ProblemSpec
from apprentice.lm import modeling
from apprentice.policies.base import Message, Turn
from apprentice.training.opd.executors import STUDENT, TEACHER, EpisodeState, Executor
from apprentice.training.opd.privileged import Kind, privileged_messages

ACTOR_KEY = "opd_actor"


# ---- scoring ----------------------------------------------------------------------------------------
@torch.no_grad()
def mean_logprobs(model: Any, tokenizer: Any, prompts: Sequence[str], actions: Sequence[str],
                  dtype: str | torch.dtype = "fp32", batch_size: int = 16) -> list[float | None]:
    """Mean log-probability of each ``actions[i]``'s tokens after ``prompts[i]`` under ``model``
    (``None`` for an empty action)."""
    out: list[float | None] = []
    device = next(model.parameters()).device
    for s in range(0, len(prompts), batch_size):
        p_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts[s:s + batch_size]]
        a_ids = [tokenizer(a, add_special_tokens=False)["input_ids"] for a in actions[s:s + batch_size]]
        rows = [p + a for p, a in zip(p_ids, a_ids, strict=True)]
        width = max(len(r) for r in rows)
        pad = tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
        att = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        keep = min(max(max(len(a) for a in a_ids), 1) + 1, width)  # vocabulary head only where scored
        with modeling.autocast(dtype, device):
            logits = model(input_ids=ids, attention_mask=att, logits_to_keep=keep).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, width - keep + 1:, None]).squeeze(-1)
        for i, a in enumerate(a_ids):
            out.append(float(logp[i, logp.size(1) - len(a):].mean()) if a else None)
    return out


# ---- the mixed policy -------------------------------------------------------------------------------
@dataclass
class MixedPolicy:
    """Routes each episode's next turn to the student or the teacher policy, as ``executor`` decides."""

    student: Any  # a Policy (HFPolicy over the model being trained)
    teacher: Any  # a Policy (HFPolicy over the teacher, or the frozen privileged self-teacher)
    executor: Executor
    step: int = 0
    privileged: Kind = "none"  # teacher's prompt carries privileged context (self-distillation)
    dtype: str | torch.dtype = "fp32"
    policy_id: str = "opd-mixed"
    needs_oracle_plan: bool = True  # rollout engine then passes each episode's private context dict

    def __post_init__(self) -> None:
        self._episodes = 0

    def _state(self, ctx: dict[str, Any]) -> EpisodeState:
        if "_opd" not in ctx:
            ctx["_opd"] = self.executor.new_episode(self._episodes, self.step)
            self._episodes += 1
        return ctx["_opd"]

    def teacher_view(self, conv: list[Message], ctx: dict[str, Any]) -> list[Message]:
        return privileged_messages(conv, ctx, self.privileged) if self.privileged != "none" else conv

    def act(self, conversations: list[list[Message]], tools: list[list[dict[str, Any]]], *,
            contexts: list[dict[str, Any]] | None = None) -> list[Turn]:
        contexts = contexts if contexts is not None else [{} for _ in conversations]
        states = [self._state(c) for c in contexts]
        actors = [self.executor.act(s, len(s.actors), self.step) for s in states]
        turns: list[Turn | None] = [None] * len(conversations)
        for who, pol in ((STUDENT, self.student), (TEACHER, self.teacher)):
            idx = [i for i, a in enumerate(actors) if a == who]
            if not idx:
                continue
            convs = [conversations[i] if who == STUDENT else self.teacher_view(conversations[i], contexts[i])
                     for i in idx]
            for i, t in zip(idx, pol.act(convs, [tools[i] for i in idx]), strict=True):
                t.message = {**t.message, ACTOR_KEY: who}
                turns[i] = t
        disc: list[float | None] = [None] * len(conversations)
        if self.executor.needs_discrepancy:
            disc = self._discrepancies(conversations, tools, contexts, actors, turns)
        for s, a, d in zip(states, actors, disc, strict=True):
            self.executor.observe(s, a, d)
        return [t for t in turns if t is not None]

    def _discrepancies(self, convs, tools, contexts, actors, turns) -> list[float | None]:
        s_prompts = [self.student.render(c, t) for c, t in zip(convs, tools, strict=True)]
        t_prompts = [self.teacher.render(self.teacher_view(c, x), t) for c, t, x in zip(convs, tools, contexts, strict=True)]
        actions = [t.raw for t in turns]
        lp_s = mean_logprobs(self.student.model, self.student.tokenizer, s_prompts, actions, self.dtype)
        lp_t = mean_logprobs(self.teacher.model, self.teacher.tokenizer, t_prompts, actions, self.dtype)
        out: list[float | None] = []
        for a, s, t in zip(actors, lp_s, lp_t, strict=True):
            if s is None or t is None:
                out.append(None)
            else:
                out.append(s - t if a == STUDENT else t - s)
        return out


# ---- trajectories -> tensors --------------------------------------------------------------------------
def oracle_context(spec: ProblemSpec, env_factory: Callable[[ProblemSpec], Environment] | None = None) -> dict:
    """The privileged context the engine gave the episode (recomputed: it never enters trajectories)."""
    env = env_factory(spec) if env_factory else FAMILIES[spec.family]()
    env.reset(spec=spec)
    return {"oracle_plan": [{"name": c.name, "arguments": dict(c.arguments)} for c in env.oracle()]}


@dataclass
class Encoded:
    prompt_ids: list[int]
    teacher_prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[int]  # 1 = a student-written assistant token (trained on)
    turn_index: list[int]  # assistant turn number of each completion token (-1 outside assistant turns)
    actors: list[str]


def encode_trajectory(traj: Trajectory, tokenizer: Any, *, privileged: Kind = "none",
                      context: dict | None = None, train_teacher_turns: bool = False,
                      max_length: int | None = None) -> Encoded:
    """Render a finished episode with the chat template: prompt = system + first user message; the
    completion is everything after it (assistant turns, tool responses, error observations)."""
    msgs = [{k: v for k, v in m.items() if k != ACTOR_KEY} for m in traj.messages]
    actors = [m.get(ACTOR_KEY, STUDENT) for m in traj.messages if m.get("role") == "assistant"]
    tools = traj.tools or None
    enc = tokenizer.apply_chat_template(msgs, tools=tools, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    ids, amask = list(enc["input_ids"]), list(enc["assistant_masks"])
    prompt_text = tokenizer.apply_chat_template(msgs[:2], tools=tools, tokenize=False)
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    if ids[:len(prompt_ids)] != prompt_ids:
        raise ValueError("the chat template is not prefix-preserving (prompt tokens differ inside the full "
                         "conversation); use model.chat_template=compact or qwen2.5")
    comp, cmask = ids[len(prompt_ids):], amask[len(prompt_ids):]
    turn_index, loss_mask, k, prev = [], [], -1, 0
    for m in cmask:
        if m and not prev:
            k += 1
        prev = m
        turn_index.append(k if m else -1)
        actor = actors[k] if (m and k < len(actors)) else None
        loss_mask.append(int(bool(m) and (actor == STUDENT or (train_teacher_turns and actor == TEACHER))))
    teacher_prompt_ids = prompt_ids
    if privileged != "none":
        t_text = tokenizer.apply_chat_template(privileged_messages(msgs[:2], context or {}, privileged),
                                               tools=tools, tokenize=False)
        teacher_prompt_ids = tokenizer(t_text, add_special_tokens=False)["input_ids"]
    if max_length is not None and len(comp) > max_length:
        comp, loss_mask, turn_index = comp[:max_length], loss_mask[:max_length], turn_index[:max_length]
    return Encoded(prompt_ids, teacher_prompt_ids, comp, loss_mask, turn_index, actors)


def episode_stats(traj: Trajectory) -> dict[str, float]:
    actors = [m.get(ACTOR_KEY, STUDENT) for m in traj.messages if m.get("role") == "assistant"]
    switches = sum(a != b for a, b in zip(actors, actors[1:], strict=False))
    return {
        "teacher_share": sum(a == TEACHER for a in actors) / max(len(actors), 1),
        "switches": float(switches),
        "success": float(traj.success),
        "reward": float(traj.reward),
        "traj_turns": float(traj.turns),
    }


def specs_from_rows(rows: Sequence[dict[str, Any]]) -> list[ProblemSpec]:
    out = []
    for r in rows:
        if "spec" not in r:
            raise ValueError("OPD training rows need a 'spec' column (ProblemSpec JSON); build the dataset with "
                         "apprentice.training.opd.trainer.problems_dataset")
        s = r["spec"]
        out.append(ProblemSpec.from_json(s if isinstance(s, str) else json.dumps(s)))
    return out
