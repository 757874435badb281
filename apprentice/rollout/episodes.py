"""Batched multi-episode rollout engine: specs + a policy in, whole trajectories out.

Why hand-written: TRL's GRPOTrainer runs its own tool loop, but only inside training and only for
its sampler's batch; verifiers/rllm/NeMo-Gym bring whole servers. What the pipeline needs (teacher
collection, evaluation, the bench) is a lock-step loop over many episodes at once: every round,
each live episode's next assistant turn is generated in ONE ``policy.act`` call (chunked by
``batch_size``), so a local model decodes a whole batch per forward pass instead of one sequence.
Episodes finish independently (reward reached or turn budget spent) and drop out of later rounds.

Malformed model output never crashes a run: a turn with ``parse_error`` (or with no tool call where
one is required) is answered with an error observation telling the agent the expected format, and
counted in ``parse_errors``; tool observations starting with ``Error`` count as ``tool_errors``.
``max_format_errors`` > 0 ends an episode after that many *consecutive* unparseable turns (reward
0, ``stopped = "format_errors"`` in ``extra``): a model that has not learned the format (the base
model, a freshly pruned student) otherwise spends its whole turn budget producing prose, and
evaluating it would cost as much as evaluating a working agent. ``max_repeats`` > 0 likewise ends an
episode (``stopped = "repeats"``) once the same calls got the same observations that many turns in a
row: nothing the agent sees changes, so a greedy agent plays the same turn until its budget runs out,
and those turns, the longest-context ones of the episode, were a quarter of an evaluation's turns.

A policy that cannot produce a turn at all (an endpoint request that failed after its retries)
returns a :class:`~apprentice.policies.base.Turn` with ``error``: only that episode ends, as
*failed* (``success = False``, ``extra.error`` = the error, ``extra.failed = True``), and the batch
plays on. When ``policy.act`` itself raises (an endpoint that is down, a bug), the episodes that had
already finished are attached to the exception (:func:`finished_before`), so the shard runner keeps
them instead of replaying them.

``on_finish`` hands each episode over the moment it finishes (in finish order, failed ones
included), so a caller can put it on disk before the batch ends: a process killed mid-batch then
loses only the episodes still playing (:mod:`apprentice.rollout.shards` journals them). It changes
neither the batching nor the results.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from apprentice.data.trajectories import Trajectory, specs_of
from apprentice.envs import Environment, ProblemSpec, ToolCall, resolve
from apprentice.policies.base import Message, Policy, Turn

log = logging.getLogger(__name__)

#: How a tool call is written by the chat templates we ship (compact and Qwen2.5 both use it).
#: A policy may override it with a ``tool_call_format`` attribute.
DEFAULT_TOOL_CALL_FORMAT = '<tool_call>\n{"name": "<tool name>", "arguments": {<arguments as JSON>}}\n</tool_call>'


@dataclass
class _Episode:
    """Mutable state of one running episode."""

    spec: ProblemSpec
    level: int
    sample_idx: int
    env: Environment
    tools: list[dict[str, Any]]
    messages: list[Message]
    budget: int
    context: dict[str, Any] = field(default_factory=dict)
    turns: int = 0
    parse_errors: int = 0
    format_streak: int = 0  # consecutive unparseable turns (max_format_errors)
    last_step: str | None = None  # the previous turn's calls and observations (max_repeats)
    repeat_streak: int = 0  # consecutive turns equal to it, this one included
    stopped: str = ""
    tool_errors: int = 0
    tool_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    episode_tokens: int = 0  # generated + tool-response tokens (the GRPO-style budget)
    finished: bool = False
    truncated: bool = False
    wall_s: float = 0.0
    error: str = ""  # the policy could not produce a turn: the episode failed (not a model outcome)
    context_turns: int = 0  # messages a replayed start (``starts``) left: context, not the policy's

    def size(self) -> int:
        """Rough prompt length (characters) to group similar lengths into one batch."""
        return sum(len(str(m.get("content") or "")) for m in self.messages)


def _as_tool_call(entry: Mapping[str, Any]) -> ToolCall:
    """An assistant ``tool_calls`` entry (HF/OpenAI shape, arguments as dict or JSON string)."""
    fn = entry.get("function", entry)
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    if not isinstance(args, Mapping):
        raise ValueError(f"arguments must be a JSON object, got {type(args).__name__}")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("tool call has no function name")
    return ToolCall(name, dict(args))


def _format_error(reason: str, tool_names: list[str], fmt: str) -> str:
    return (
        f"Error: {reason}. Reply with exactly one tool call in this format:\n{fmt}\n"
        f"Available tools: {', '.join(tool_names)}."
    )


def _levels_for(specs: Sequence[ProblemSpec], levels: Sequence[int] | Mapping[str, int] | None) -> list[int]:
    if levels is None:
        return [-1] * len(specs)  # unknown: the problems table is the source of levels
    if isinstance(levels, Mapping):
        return [int(levels.get(s.problem_id, -1)) for s in specs]
    if len(levels) != len(specs):
        raise ValueError(f"got {len(levels)} levels for {len(specs)} specs; pass one level per spec")
    return [int(x) for x in levels]


def _seed_everything(seed: int) -> tuple[Any, Any]:
    """Seed Python's and torch's global RNGs for the rollout; return their previous states, which
    :func:`_restore_rng` puts back when the rollout ends: a rollout inside training (OPD) must not
    reseed the trainer's dropout and data order every step."""
    import random

    before = random.getstate()
    random.seed(seed)
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency, but policies may not need it
        return before, None
    torch_before = (torch.random.get_rng_state(),
                    torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    torch.manual_seed(seed)
    return before, torch_before


def _restore_rng(state: tuple[Any, Any]) -> None:
    import random

    random.setstate(state[0])
    if state[1] is not None:
        import torch

        torch.random.set_rng_state(state[1][0])
        if state[1][1] is not None:
            torch.cuda.set_rng_state_all(state[1][1])


def run_episodes(
    specs: Sequence[ProblemSpec] | pd.DataFrame,
    policy: Policy,
    *,
    samples_per_problem: int = 1,
    max_turns: int = 0,
    batch_size: int = 64,
    progress: bool = True,
    policy_id: str | None = None,
    levels: Sequence[int] | Mapping[str, int] | None = None,
    seed: int = 0,
    require_tool_call: bool = True,
    env_factory: Callable[[ProblemSpec], Environment] | None = None,
    max_format_errors: int = 0,
    max_repeats: int = 0,
    episode_tokens: int = 0,
    count_tokens: Callable[[str], int] | None = None,
    starts: Sequence[Sequence[Mapping[str, Any]]] | None = None,
    on_finish: Callable[[Trajectory], None] | None = None,
    skip: Collection[tuple[str, int]] | None = None,
) -> list[Trajectory]:
    """Run ``samples_per_problem`` episodes of every spec with ``policy``; return one Trajectory each.

    ``specs`` may be a problems table (``trajectories.problems_frame``), whose ``level`` column then
    fills ``Trajectory.level``; otherwise pass ``levels`` (one per spec, or problem_id -> level).
    ``max_turns`` > 0 caps every episode's own budget (``env.turn_budget()``). Each round makes
    one ``policy.act`` call for at most ``batch_size`` live episodes (fewer when the policy's optional
    ``live_rows(batch_size)`` says it holds fewer, asked every round); a finished episode's place goes
    to the next waiting one, largest turn budget first (episode-level continuous batching). ``seed`` seeds torch (sampling).
    ``max_format_errors`` > 0 stops an episode after that many consecutive unparseable turns;
    ``max_repeats`` > 0 after that many consecutive turns with the same calls and the same observations.
    ``episode_tokens`` > 0 budgets the whole episode the way TRL's GRPO budgets a multi-turn
    completion (``max_completion_length``): generated tokens *plus* tool responses (counted with
    ``count_tokens``); a turn that would pass the budget is cut (truncated, its calls not run).
    ``starts`` (one per spec): assistant turns to replay first, through the same engine, in a fresh
    environment; the policy then continues from the state they reach (the loop's ``repair`` rule:
    a failed episode cut at its first error, continued by the teacher). The observations come from
    the replay, not from the caller, and ``extra["context_turns"]`` records how many messages the
    replayed start left (training masks them).
    ``on_finish(trajectory)`` is called once per episode as soon as it finishes (failed episodes, with
    ``extra.error``, included; an episode a replayed start already finished, before the first round),
    with a Trajectory equal to the one the returned list holds; an exception it raises ends the run.
    ``skip``: (problem_id, sample index) pairs not to play (a caller resuming a killed run already has
    them); the other samples of those problems keep their sample index. They are absent from the result.
    Results are ordered by (spec, sample index).
    """
    if isinstance(specs, pd.DataFrame):
        if levels is None and "level" in specs.columns:
            levels = [int(x) for x in specs["level"]]
        specs = specs_of(specs)
    specs = list(specs)
    if samples_per_problem < 1:
        raise ValueError("samples_per_problem must be >= 1")
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    if episode_tokens > 0 and count_tokens is None:
        raise ValueError("episode_tokens needs count_tokens (e.g. lambda s: len(tokenizer(s)['input_ids']))")
    lv = _levels_for(specs, levels)
    pid = policy_id or getattr(policy, "policy_id", None) or type(policy).__name__
    wants_plan = _wants_plan(policy)
    # a policy may hold fewer conversations at once than asked, asked again every round as they grow:
    # the KV-cache engine keeps keys/values under a byte budget (CachedHFPolicy.live_rows)
    live_rows = getattr(policy, "live_rows", None)
    if not callable(live_rows):
        live_rows = None
    fmt = getattr(policy, "tool_call_format", None) or DEFAULT_TOOL_CALL_FORMAT
    make_env = env_factory or _default_env
    rng_state = _seed_everything(seed)

    if starts is not None and len(starts) != len(specs):
        raise ValueError(f"starts: one list of assistant turns per spec ({len(specs)}), got {len(starts)}")
    episodes: list[_Episode] = []
    for i, (spec, level) in enumerate(zip(specs, lv, strict=True)):
        for k in range(samples_per_problem):
            if skip and (spec.problem_id, k) in skip:
                continue
            env = make_env(spec)
            first = env.reset(spec=spec)
            budget = int(env.turn_budget())
            if max_turns > 0:
                budget = min(budget, max_turns)
            context: dict[str, Any] = {}
            if wants_plan:  # privileged: only the oracle asks for it, and it never reaches trajectories
                context["oracle_plan"] = [{"name": c.name, "arguments": dict(c.arguments)} for c in env.oracle()]
            episodes.append(
                _Episode(
                    spec=spec, level=level, sample_idx=k, env=env, tools=type(env).tool_schemas(),
                    messages=[{"role": "system", "content": env.system_prompt}, {"role": "user", "content": first}],
                    budget=max(budget, 1), context=context,
                )
            )
            if starts is not None:
                _replay_start(episodes[-1], starts[i], fmt, require_tool_call)

    # Admission order: largest turn budget first (stable: problem order among equals). Admitted in
    # problem order, the long episodes (hard levels) would start last and finish alone, in late rounds
    # of a few rows each that take a large share of the time. Started first, they run beside the short
    # ones and the batch stays full to the end. Results keep spec order.
    queue = sorted(episodes, key=lambda e: -e.budget)
    t0 = time.perf_counter()
    bar = tqdm(total=len(episodes), desc=f"rollout {pid}", unit="ep", disable=not progress, dynamic_ncols=True)
    done = successes = gen_tokens = 0
    try:
        if on_finish is not None:  # finished by its replayed start: never reaches a round
            for e in episodes:
                if e.finished:
                    on_finish(_trajectory(e, pid))
        while True:
            # Refill: at most batch_size episodes play at once, admitted in queue order; one that finishes
            # hands its row to the next waiting one, so a round's batch stays full until the queue
            # drains (all-live lock-step rounds left late rounds with a few long episodes each).
            rows = batch_size if live_rows is None else max(1, min(batch_size, int(live_rows(batch_size))))
            live = [e for e in queue if not e.finished][:rows]
            if not live:
                break
            # Longest conversations first: similar lengths side by side (less padding per batch).
            live.sort(key=_Episode.size, reverse=True)
            try:
                turns = policy.act(
                    [e.messages for e in live],
                    [e.tools for e in live],
                    contexts=[e.context for e in live] if wants_plan else None,
                )
            except Exception as exc:
                # keep what finished: the caller may save it and replay only the rest
                exc.finished_episodes = [_trajectory(e, pid) for e in episodes  # type: ignore[attr-defined]
                                         if e.finished and not e.error]
                raise
            if len(turns) != len(live):
                raise RuntimeError(
                    f"policy {pid} returned {len(turns)} turns for {len(live)} conversations; "
                    "Policy.act must return exactly one Turn per conversation"
                )
            for ep, turn in zip(live, turns, strict=True):
                _apply(ep, turn, fmt, require_tool_call, max_format_errors, episode_tokens, count_tokens, max_repeats)
                gen_tokens += turn.completion_tokens
                if ep.finished:
                    ep.wall_s = time.perf_counter() - t0
                    done += 1
                    successes += ep.env.get_reward() >= 1.0
                    bar.update(1)
                    if on_finish is not None:
                        on_finish(_trajectory(ep, pid))
            elapsed = max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix(success=f"{successes}/{done}", tok_s=f"{gen_tokens / elapsed:.0f}")
    finally:
        bar.close()
        _restore_rng(rng_state)

    return [_trajectory(e, pid) for e in episodes]


def _replay_start(ep: _Episode, turns: Sequence[Mapping[str, Any]], fmt: str, require_tool_call: bool) -> None:
    """Play ``turns`` (assistant messages) into ``ep`` as if a policy had produced them."""
    from apprentice.policies.toolcalls import render_assistant

    for m in turns:
        if ep.finished:
            break
        msg = {"role": "assistant", "content": m.get("content") or "", **({"tool_calls": list(m["tool_calls"])}
                                                                        if m.get("tool_calls") else {})}
        _apply(ep, Turn(message=msg, raw=render_assistant(msg)), fmt, require_tool_call)
    ep.context_turns = len(ep.messages)


def _wants_plan(policy: Policy) -> bool:
    """Privileged context goes only to policies that ask for it (``needs_oracle_plan = True``) and to
    the oracle, which needs it by definition."""
    flag = getattr(policy, "needs_oracle_plan", None)
    if flag is not None:
        return bool(flag)
    from apprentice.policies.oracle import OraclePolicy

    return isinstance(policy, OraclePolicy)


def _default_env(spec: ProblemSpec) -> Environment:
    return resolve(spec.family)()  # built-in, adapter, envs.modules or entry-point family


def _apply(ep: _Episode, turn: Turn, fmt: str, require_tool_call: bool, max_format_errors: int = 0,
           episode_tokens: int = 0, count_tokens: Callable[[str], int] | None = None, max_repeats: int = 0) -> None:
    """Append the assistant turn and its observations; update counters and the finish state."""
    if turn.error:  # no turn at all (the endpoint failed for good): this episode fails, the batch goes on
        ep.finished, ep.error = True, " ".join(str(turn.error).split())[:1000]
        return
    ep.turns += 1
    ep.prompt_tokens += int(turn.prompt_tokens)
    ep.completion_tokens += int(turn.completion_tokens)
    ep.episode_tokens += int(turn.completion_tokens)
    if episode_tokens > 0 and ep.episode_tokens > episode_tokens:  # cut mid-turn: the call never completes
        ep.messages.append({"role": "assistant", "content": turn.raw or ""})
        ep.finished = ep.truncated = True
        ep.stopped = "episode_tokens"
        return
    msg = dict(turn.message)
    msg["role"] = "assistant"
    msg.setdefault("content", turn.raw if turn.parse_error else "")
    names = type(ep.env).tool_names()

    calls: list[ToolCall] = []
    error = turn.parse_error
    if error is None:
        try:
            calls = [_as_tool_call(c) for c in turn.tool_calls]
        except (ValueError, TypeError, AttributeError) as e:
            error = f"malformed tool call ({e})"
        if not calls and error is None and require_tool_call:
            error = "no tool call found in your reply"
    if error is not None:
        msg.pop("tool_calls", None)  # a failed parse must not leave half a call in the transcript
        ep.messages.append(msg)
        ep.parse_errors += 1
        ep.format_streak += 1
        ep.last_step, ep.repeat_streak = None, 0
        ep.messages.append({"role": "user", "content": _format_error(error, names, fmt)})
    else:
        ep.format_streak = 0
        ep.messages.append(msg)
        observed: list[str] = []
        for call in calls:
            if ep.env.done:
                break
            obs = _execute(ep.env, call)
            ep.tool_calls += 1
            if obs.lstrip().startswith("Error"):
                ep.tool_errors += 1
            ep.messages.append({"role": "tool", "name": call.name, "content": obs})
            observed.append(obs)
            if count_tokens is not None:
                ep.episode_tokens += count_tokens(obs)
        step = json.dumps([[c.name, dict(c.arguments)] for c in calls] + observed, sort_keys=True, default=str)
        ep.repeat_streak = ep.repeat_streak + 1 if step == ep.last_step else 1
        ep.last_step = step

    if ep.env.done:
        ep.finished = True
    elif max_format_errors > 0 and ep.format_streak >= max_format_errors:
        ep.finished, ep.stopped = True, "format_errors"
    elif max_repeats > 0 and ep.repeat_streak >= max_repeats:
        ep.finished, ep.stopped = True, "repeats"
    elif ep.turns >= ep.budget:
        ep.finished = ep.truncated = True


def _execute(env: Environment, call: ToolCall) -> str:
    """Tools must not raise (envs/base.py); if one does, the agent sees an error, the run goes on."""
    try:
        return env.execute(call)
    except Exception as e:  # noqa: BLE001 - a buggy tool must not kill a whole rollout of many episodes
        log.warning("tool %s of %s raised %s: %s", call.name, env.family, type(e).__name__, e)
        return f"Error: tool {call.name} failed: {type(e).__name__}: {e}"


def finished_before(exc: BaseException) -> list[Trajectory]:
    """The episodes that had finished when ``run_episodes`` raised ``exc`` (empty if none, or if the
    exception did not come from the engine)."""
    return list(getattr(exc, "finished_episodes", None) or [])


def _trajectory(ep: _Episode, policy_id: str) -> Trajectory:
    reward = 0.0 if ep.error else float(ep.env.get_reward())
    failed = {"error": ep.error, "failed": True} if ep.error else {}
    return Trajectory(
        problem_id=ep.spec.problem_id,
        family=ep.spec.family,
        spec=ep.spec.to_json(),
        difficulty=json.dumps(dict(sorted(ep.spec.difficulty.items()))),
        level=ep.level,
        policy_id=policy_id,
        sample_idx=ep.sample_idx,
        messages=ep.messages,
        tools=ep.tools,
        reward=reward,
        success=reward >= 1.0,
        turns=ep.turns,
        truncated=ep.truncated,
        tool_errors=ep.tool_errors,
        parse_errors=ep.parse_errors,
        prompt_tokens=ep.prompt_tokens,
        completion_tokens=ep.completion_tokens,
        wall_s=round(ep.wall_s, 4),
        extra={"budget": ep.budget, "tool_calls": ep.tool_calls, **({"stopped": ep.stopped} if ep.stopped else {}),
               **({"context_turns": ep.context_turns} if ep.context_turns else {}),
               **failed},
    )
