"""The oracle: replays each episode's privileged optimal plan, one tool call per assistant turn.

The rollout engine passes the plan in ``contexts[i]["oracle_plan"]`` (a list of
``{"name", "arguments"}`` computed by the environment's solver), so this module never imports
environments. The turn index is the number of assistant messages already in the conversation,
which makes the oracle stateless: the same conversation always gets the same answer.
"""

from __future__ import annotations

from typing import Any

from apprentice.policies.base import Message, Turn
from apprentice.policies.toolcalls import assistant_message, render_assistant


class OraclePolicy:
    policy_id = "oracle"

    def act(
        self,
        conversations: list[list[Message]],
        tools: list[list[dict[str, Any]]],
        *,
        contexts: list[dict[str, Any]] | None = None,
    ) -> list[Turn]:
        if contexts is None or len(contexts) != len(conversations):
            raise ValueError("OraclePolicy needs contexts[i]['oracle_plan'] for every conversation; "
                             "the rollout engine supplies it from the environment's oracle")
        turns = []
        for conv, ctx in zip(conversations, contexts, strict=True):
            if "oracle_plan" not in ctx:
                raise ValueError("context lacks 'oracle_plan' (list of {'name', 'arguments'})")
            plan = ctx["oracle_plan"]
            k = sum(1 for m in conv if m.get("role") == "assistant")
            if k < len(plan):
                step = plan[k]
                msg = assistant_message("", [{"name": step["name"], "arguments": step.get("arguments", {})}])
                turns.append(Turn(message=msg, raw=render_assistant(msg)))
            else:  # plan exhausted (the env should have ended the episode); say so instead of calling
                msg = assistant_message("I have completed the plan.")
                turns.append(Turn(message=msg, raw=msg["content"], extra={"plan_exhausted": True}))
        return turns
